"""Flow control per tenant and per key: a priority band and a limit on sequences in flight.

`priority` names a band of `inferplane.api.priority.BANDS` (NULL: the key takes its tenant's, the
tenant the deployment's, else the default); it is validated by the code that writes it, not by a
CHECK constraint, so a band added later needs no migration. `max_concurrent_sequences` caps the
sequences (prompts × n) a key, or all of a tenant's keys together, may have in flight (NULL: none).

Revision ID: 0004_flow_control
Revises: 0003_alerts
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_flow_control"
down_revision = "0003_alerts"
branch_labels = None
depends_on = None

_TABLES = ("tenants", "api_keys")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("priority", sa.String(16), nullable=True))
            batch.add_column(sa.Column("max_concurrent_sequences", sa.Integer(), nullable=True))


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("max_concurrent_sequences")
            batch.drop_column("priority")
