"""The control plane's tables (SQLAlchemy 2.0 declarative).

The schema itself is owned by the Alembic migrations in `migrations/versions/`; these classes must
match them (a test compares the two). Timestamps are stored as naive UTC, which both SQLite and
PostgreSQL keep exactly, and handed back to Python timezone-aware so no caller mixes the two.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

MODEL_STATUSES = ("registered", "verified", "failed")
VISIBILITIES = ("public", "private")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores naive UTC, returns aware UTC; rejects naive input so local times never sneak in."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use an aware datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    """A customer. The id is a short slug chosen at creation (it appears in logs, metrics and CLIs)."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    display_name: Mapped[str | None] = mapped_column(String(255))
    monthly_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    # Ceilings for every key of the tenant (NULL: none); a tenant admin cannot mint keys above them.
    key_requests_per_minute_max: Mapped[int | None] = mapped_column(BigInteger)
    key_tokens_per_minute_max: Mapped[int | None] = mapped_column(BigInteger)
    # Flow control (api/priority.py): the band its requests get unless their key sets one (NULL: the
    # deployment's, else the default), and the sequences all its keys may have in flight at once.
    priority: Mapped[str | None] = mapped_column(String(16))
    max_concurrent_sequences: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class ApiKey(Base):
    """An API key `ip_<id>_<secret>`: only the id and a hash of the secret are kept.

    `updated_at` moves on every change that affects verification (create, revoke) so key caches can
    ask for changes since their last refresh; `last_used_at` is written in batches and does not move it.
    """

    __tablename__ = "api_keys"
    __table_args__ = (
        Index("ix_api_keys_tenant_id", "tenant_id"),
        Index("ix_api_keys_updated_at", "updated_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str | None] = mapped_column(String(255))
    secret_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    scopes: Mapped[str] = mapped_column(String(255), nullable=False)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    # The key's band (NULL: its tenant's) and its own limit on sequences in flight (NULL: none).
    priority: Mapped[str | None] = mapped_column(String(16))
    max_concurrent_sequences: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Model(Base):
    """A registered model version. `owner_tenant_id` NULL means a platform model (always public).

    Names are unique per `namespace`: "" for platform models, the owner's tenant id for a tenant's
    (always private), so a tenant's registration can never take or shadow a platform name.
    """

    __tablename__ = "models"
    __table_args__ = (
        UniqueConstraint("namespace", "name", "version", name="uq_models_namespace_name_version"),
        CheckConstraint("status IN ('registered', 'verified', 'failed')", name="ck_models_status"),
        CheckConstraint("visibility IN ('public', 'private')", name="ck_models_visibility"),
        CheckConstraint(
            "owner_tenant_id IS NOT NULL OR visibility = 'public'", name="ck_models_private_has_owner"
        ),
        Index("ix_models_owner_tenant_id", "owner_tenant_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    namespace: Mapped[str] = mapped_column(String(64), nullable=False, default="", server_default="")
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    version: Mapped[str] = mapped_column(String(64), nullable=False)
    uri: Mapped[str] = mapped_column(Text, nullable=False)
    format: Mapped[str] = mapped_column(String(16), nullable=False)
    sha256: Mapped[str | None] = mapped_column(String(64))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # The canonical architecture (api/architectures.py) and its kind, "generate" or "embedding".
    # Rows registered before revision 0005 have the architecture as the file spelled it and no kind.
    architecture: Mapped[str | None] = mapped_column(String(128))
    kind: Mapped[str | None] = mapped_column(String(16))
    context_length: Mapped[int | None] = mapped_column(Integer)
    # A LoRA adapter (kind "adapter", format "peft"): the base model version ("name:version") it was
    # checked against at registration, that version's digest (what replicas must serve), its rank.
    base_model: Mapped[str | None] = mapped_column(String(193))
    base_sha256: Mapped[str | None] = mapped_column(String(64))
    lora_rank: Mapped[int | None] = mapped_column(Integer)
    # Whether the weights' tokenizer has a chat template (a chat model, not a base one); NULL on
    # rows from before revision 0008 and on pvc:// entries, which are not read at registration.
    chat_template: Mapped[bool | None] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="registered")
    status_detail: Mapped[str | None] = mapped_column(Text)
    owner_tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    visibility: Mapped[str] = mapped_column(String(16), nullable=False, default="public")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class Usage(Base):
    """Requests and tokens per (tenant, served model name, minute), upserted by the usage recorder.

    No foreign keys: usage is billing history and must outlive deleted models and tenants.
    """

    __tablename__ = "usage"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class AuditLog(Base):
    """One row per admin action. No foreign keys, for the same reason as `Usage`."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_at", "at"),
        Index("ix_audit_log_tenant_id", "tenant_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    actor: Mapped[str] = mapped_column(String(255), nullable=False)
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    target: Mapped[str | None] = mapped_column(String(255))
    tenant_id: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)


ALERT_STATUSES = ("firing", "resolved")
DELIVERY_STATES = ("pending", "delivered", "failed")


class Alert(Base):
    """One alert from Alertmanager, deduplicated by its fingerprint (a hash of its labels): the
    resolved notification, and every repeat, update the same row.

    `tenant_id` is the alert's `tenant` label when it names an existing tenant, else NULL (platform
    alerts). ON DELETE CASCADE: a deleted tenant's alerts go with it; SET NULL would turn them into
    platform alerts, indistinguishable from ones that never had a tenant.
    """

    __tablename__ = "alerts"
    __table_args__ = (
        UniqueConstraint("fingerprint", name="uq_alerts_fingerprint"),
        CheckConstraint("status IN ('firing', 'resolved')", name="ck_alerts_status"),
        Index("ix_alerts_tenant_id", "tenant_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(128), nullable=False)
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    annotations: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    starts_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    ends_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    generator_url: Mapped[str | None] = mapped_column(Text)
    first_received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    last_received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class TenantWebhook(Base):
    """A URL a tenant's alerts are POSTed to, signed with `secret` (HMAC-SHA256). The secret is
    kept as is, not hashed: the forwarder needs it to sign. One row per (tenant, URL)."""

    __tablename__ = "tenant_webhooks"
    __table_args__ = (UniqueConstraint("tenant_id", "url", name="uq_tenant_webhooks_tenant_id_url"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    url: Mapped[str] = mapped_column(String(2048), nullable=False)
    secret: Mapped[str] = mapped_column(String(255), nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class AlertDelivery(Base):
    """The outbox and the delivery log in one: one row per (alert transition, tenant webhook),
    written in the transaction that records the transition, so a notification is never lost between
    the two. `next_attempt_at` is when a pending row is due (the forwarder also pushes it forward
    while it holds the row); delivered and failed rows keep their last status code and error.

    `webhook_id` goes NULL when the webhook is removed (the log stays; a pending row then fails);
    `webhook_url` keeps where it was sent.
    """

    __tablename__ = "alert_deliveries"
    __table_args__ = (
        CheckConstraint("alert_status IN ('firing', 'resolved')", name="ck_alert_deliveries_alert_status"),
        CheckConstraint("state IN ('pending', 'delivered', 'failed')", name="ck_alert_deliveries_state"),
        Index("ix_alert_deliveries_alert_id", "alert_id"),
        Index("ix_alert_deliveries_webhook_id", "webhook_id"),
        Index("ix_alert_deliveries_state_next_attempt_at", "state", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False)
    webhook_id: Mapped[int | None] = mapped_column(ForeignKey("tenant_webhooks.id", ondelete="SET NULL"))
    webhook_url: Mapped[str] = mapped_column(String(2048), nullable=False)
    alert_status: Mapped[str] = mapped_column(String(16), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, default="pending")
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class StoredResponse(Base):
    """A Responses API answer kept for `GET /v1/responses/{id}` and for `previous_response_id`
    (stored_responses.py): the answer as it was returned, and the conversation it answered (the
    input items of every earlier turn and this one), so a follow-up needs this one row. Rows expire
    (`expires_at`, OpenAI's 30 days) and a conversation is bounded in size when it is stored.
    ON DELETE CASCADE: a deleted tenant's responses go with it."""

    __tablename__ = "responses"
    __table_args__ = (
        Index("ix_responses_tenant_id", "tenant_id"),
        Index("ix_responses_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    response: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    conversation: Mapped[list[Any]] = mapped_column(JSON, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
