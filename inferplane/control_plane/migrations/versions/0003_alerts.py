"""Alert routing: alerts from Alertmanager, tenants' webhooks, and the delivery outbox/log.

`alerts` is deduplicated by Alertmanager's fingerprint; `tenant_webhooks` holds each tenant's URLs
and HMAC secrets; `alert_deliveries` is written in the same transaction as an alert's transition
(firing or resolved) and worked off by the gateway's forwarder, so a restart loses nothing.

Revision ID: 0003_alerts
Revises: 0002_namespaces_and_key_ceilings
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_alerts"
down_revision = "0002_namespaces_and_key_ceilings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("fingerprint", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("annotations", sa.JSON(), nullable=False),
        sa.Column("starts_at", sa.DateTime(), nullable=False),
        sa.Column("ends_at", sa.DateTime(), nullable=True),
        sa.Column("generator_url", sa.Text(), nullable=True),
        sa.Column("first_received_at", sa.DateTime(), nullable=False),
        sa.Column("last_received_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("fingerprint", name="uq_alerts_fingerprint"),
        sa.CheckConstraint("status IN ('firing', 'resolved')", name="ck_alerts_status"),
    )
    op.create_index("ix_alerts_tenant_id", "alerts", ["tenant_id"])
    op.create_table(
        "tenant_webhooks",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("secret", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("tenant_id", "url", name="uq_tenant_webhooks_tenant_id_url"),
    )
    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("alert_id", sa.Integer(), sa.ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("webhook_id", sa.Integer(), sa.ForeignKey("tenant_webhooks.id", ondelete="SET NULL"),
                  nullable=True),
        sa.Column("webhook_url", sa.String(2048), nullable=False),
        sa.Column("alert_status", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=True),
        sa.Column("last_attempt_at", sa.DateTime(), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint("alert_status IN ('firing', 'resolved')", name="ck_alert_deliveries_alert_status"),
        sa.CheckConstraint("state IN ('pending', 'delivered', 'failed')", name="ck_alert_deliveries_state"),
    )
    op.create_index("ix_alert_deliveries_alert_id", "alert_deliveries", ["alert_id"])
    op.create_index("ix_alert_deliveries_webhook_id", "alert_deliveries", ["webhook_id"])
    op.create_index("ix_alert_deliveries_state_next_attempt_at", "alert_deliveries", ["state", "next_attempt_at"])


def downgrade() -> None:
    op.drop_index("ix_alert_deliveries_state_next_attempt_at", table_name="alert_deliveries")
    op.drop_index("ix_alert_deliveries_webhook_id", table_name="alert_deliveries")
    op.drop_index("ix_alert_deliveries_alert_id", table_name="alert_deliveries")
    op.drop_table("alert_deliveries")
    op.drop_table("tenant_webhooks")
    op.drop_index("ix_alerts_tenant_id", table_name="alerts")
    op.drop_table("alerts")
