"""LoRA adapters in the registry: a row of kind "adapter" (format "peft") is bound to the base model
version it was checked against, by reference and by digest, and records its rank.

Revision ID: 0006_adapters
Revises: 0005_model_kind
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_adapters"
down_revision = "0005_model_kind"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("base_model", sa.String(193), nullable=True))
        batch.add_column(sa.Column("base_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("lora_rank", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("lora_rank")
        batch.drop_column("base_sha256")
        batch.drop_column("base_model")
