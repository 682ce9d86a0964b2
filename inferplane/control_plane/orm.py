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
    architecture: Mapped[str | None] = mapped_column(String(128))
    context_length: Mapped[int | None] = mapped_column(Integer)
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
