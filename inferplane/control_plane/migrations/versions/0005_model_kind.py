"""A model's kind: "generate" or "embedding" (inferplane.api.architectures), read with its architecture
at registration.

Rows registered before this revision keep NULL: the registry derives the kind from `architecture`
when it reads them (an architecture it does not know gives none). No CHECK constraint: the kinds are
validated by the code that writes them, so a kind added later needs no migration.

Revision ID: 0005_model_kind
Revises: 0004_flow_control
Create Date: 2026-12-14
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_model_kind"
down_revision = "0004_flow_control"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("kind")
