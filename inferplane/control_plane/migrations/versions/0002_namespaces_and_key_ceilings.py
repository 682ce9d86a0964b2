"""Model names per owner (platform or tenant), and the ceilings a tenant's keys' limits may not exceed.

`models.namespace` is "" for platform models and the owner's tenant id for a tenant's: names are
unique per namespace, so a tenant cannot squat a platform name. `tenants.key_*_per_minute_max`
cap what any key of the tenant may be given (NULL: no ceiling).

Revision ID: 0002_namespaces_and_key_ceilings
Revises: 0001_initial
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_namespaces_and_key_ceilings"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("namespace", sa.String(64), nullable=False, server_default=""))
    op.execute("UPDATE models SET namespace = owner_tenant_id WHERE owner_tenant_id IS NOT NULL")
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint("uq_models_name_version", type_="unique")
        batch.create_unique_constraint("uq_models_namespace_name_version", ["namespace", "name", "version"])
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("key_requests_per_minute_max", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("key_tokens_per_minute_max", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("key_tokens_per_minute_max")
        batch.drop_column("key_requests_per_minute_max")
    # Tenants' models whose names a platform model also has would break the old constraint: drop them.
    op.execute("DELETE FROM models WHERE namespace <> '' AND name IN "
               "(SELECT name FROM models WHERE namespace = '')")
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint("uq_models_namespace_name_version", type_="unique")
        batch.create_unique_constraint("uq_models_name_version", ["name", "version"])
        batch.drop_column("namespace")
