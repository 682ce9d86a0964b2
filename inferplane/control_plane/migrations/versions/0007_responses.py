"""The Responses API's stored answers: one row per response a tenant asked to keep (`store`), with
the conversation it answered, so `previous_response_id` continues it and `GET /v1/responses/{id}`
returns it. `expires_at` bounds how long a row lives (indexed: expired rows are deleted by it).

Revision ID: 0007_responses
Revises: 0006_adapters
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_responses"
down_revision = "0006_adapters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("conversation", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_responses_tenant_id", "responses", ["tenant_id"])
    op.create_index("ix_responses_expires_at", "responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_expires_at", table_name="responses")
    op.drop_index("ix_responses_tenant_id", table_name="responses")
    op.drop_table("responses")
