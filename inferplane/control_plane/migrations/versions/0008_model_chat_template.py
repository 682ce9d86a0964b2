"""Whether a model's tokenizer has a chat template, read at registration: `models list` tells chat
models from base ones (a base model answers /v1/completions only). Older rows keep NULL (unknown)
until `models verify` reads their weights again.

Revision ID: 0008_model_chat_template
Revises: 0007_responses
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_model_chat_template"
down_revision = "0007_responses"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("chat_template", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("chat_template")
