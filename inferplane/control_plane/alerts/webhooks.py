"""Tenants' alert webhooks: where a tenant's alerts are POSTed, and the secret that signs them.

One validator serves the admin API and the CLI, so both refuse the same URLs with the same words.
A secret is generated when none is given and shown once, at creation; listings never carry it.

A tenant's admin chooses where the gateway connects, so a URL whose host is a literal internal
address (127.0.0.1, 0x7f000001, [::1], 10.0.0.0/8, 169.254.169.254...) that the outbound policy does
not allow is refused here, at once (`AddressRefused`). Names are not resolved here: what a name
resolves to when registered says nothing about what it resolves to later, so the forwarder checks
each connection's address (`control_plane.outbound`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferplane.control_plane import audit
from inferplane.control_plane.errors import InvalidInput, NotFound
from inferplane.control_plane.orm import Tenant, TenantWebhook, utcnow
from inferplane.control_plane.outbound import ENV_OUTBOUND_ALLOW, OutboundPolicy
from inferplane.control_plane.tenants import TENANT_ID_RE

MAX_URL_LENGTH = 2048
SECRET_MIN_LENGTH = 16
SECRET_MAX_LENGTH = 255
MAX_ID = 2**31 - 1  # ids are 32-bit integers


class AddressRefused(InvalidInput):
    """The URL's host is a literal address the outbound policy refuses."""

    code = "address_not_allowed"


@dataclass(frozen=True)
class WebhookInfo:
    id: int
    tenant_id: str
    url: str
    created_at: datetime


@dataclass(frozen=True)
class WebhookSet:
    """What setting a webhook returns: the webhook, whether it is new, and the secret when it was
    generated (the only time it is shown)."""

    webhook: WebhookInfo
    created: bool
    generated_secret: str | None


def _info(row: TenantWebhook) -> WebhookInfo:
    return WebhookInfo(row.id, row.tenant_id, row.url, row.created_at)


def validate_webhook_url(url: object, outbound: OutboundPolicy | None = None) -> str:
    """An absolute http(s) URL with a host that is not a literal address `outbound` refuses (None:
    the default policy, public addresses only); raises InvalidInput naming `url` otherwise."""
    if not isinstance(url, str) or not url:
        raise InvalidInput("url: required, an http:// or https:// URL")
    if len(url) > MAX_URL_LENGTH:
        raise InvalidInput(f"url: longer than {MAX_URL_LENGTH} characters")
    if url != url.strip() or any(ch.isspace() or ord(ch) < 32 for ch in url):
        raise InvalidInput("url: must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError as exc:
        raise InvalidInput(f"url: not a valid URL ({exc})") from exc
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidInput(f"url: the scheme must be http or https, got {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise InvalidInput("url: has no host")
    if port == 0:
        raise InvalidInput("url: port 0 is not a port one can connect to")
    refused = (outbound or OutboundPolicy()).refused_literal(parts.hostname)
    if refused is not None:
        shown = parts.hostname if parts.hostname == str(refused) else f"{parts.hostname} ({refused})"
        raise AddressRefused(f"url: {shown} is an internal address (loopback, private, link-local or otherwise "
                             "not public); webhooks are sent to public addresses and to those the operator allows "
                             f"(--outbound-allow, ${ENV_OUTBOUND_ALLOW})")
    return url


def validate_webhook_secret(secret: object) -> str:
    if not isinstance(secret, str) or not SECRET_MIN_LENGTH <= len(secret) <= SECRET_MAX_LENGTH:
        raise InvalidInput(f"secret: {SECRET_MIN_LENGTH} to {SECRET_MAX_LENGTH} characters")
    if not secret.isprintable() or secret != secret.strip():
        raise InvalidInput("secret: printable characters without leading or trailing spaces")
    return secret


def generate_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


def _tenant(session: Session, tenant_id: str) -> None:
    # The format first: a malformed id names no tenant, and some (a NUL) would be a database error.
    if not TENANT_ID_RE.match(tenant_id) or session.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant {tenant_id!r} not found")


def set_webhook(session: Session, tenant_id: str, url: str, *, actor: str, secret: str | None = None,
                outbound: OutboundPolicy | None = None) -> WebhookSet:
    """Adds `url` to the tenant's webhooks, or gives an existing one a new secret (generated when
    none is given). Deliveries still pending are signed with the new secret. `outbound` is the
    policy the URL's literal address is checked against (None: public addresses only)."""
    validate_webhook_url(url, outbound)
    generated = None
    if secret is None:
        secret = generated = generate_secret()
    else:
        validate_webhook_secret(secret)
    _tenant(session, tenant_id)
    row = session.scalars(select(TenantWebhook).where(TenantWebhook.tenant_id == tenant_id,
                                                      TenantWebhook.url == url)).first()
    created = row is None
    if row is None:
        row = TenantWebhook(tenant_id=tenant_id, url=url, secret=secret, created_at=utcnow())
        session.add(row)
    else:
        row.secret = secret
    session.flush()
    audit.record(session, actor=actor, action="tenant.webhook.set", target=str(row.id), tenant_id=tenant_id,
                 detail={"url": url, "created": created, "secret_generated": generated is not None})
    return WebhookSet(_info(row), created, generated)


def list_webhooks(session: Session, tenant_id: str) -> list[WebhookInfo]:
    _tenant(session, tenant_id)
    rows = session.scalars(select(TenantWebhook).where(TenantWebhook.tenant_id == tenant_id)
                           .order_by(TenantWebhook.id))
    return [_info(r) for r in rows]


def remove_webhook(session: Session, tenant_id: str, webhook: int | str, *, actor: str) -> WebhookInfo:
    """Removes a webhook by id or by its exact URL. Its delivery log stays (`webhook_id` NULL);
    deliveries still pending to it fail instead of being sent unsigned."""
    _tenant(session, tenant_id)
    query = select(TenantWebhook).where(TenantWebhook.tenant_id == tenant_id)
    if isinstance(webhook, int) or (webhook.isascii() and webhook.isdigit()):
        if not 0 < int(webhook) <= MAX_ID:  # beyond the column's range: no such row (not a database error)
            raise NotFound(f"tenant {tenant_id!r} has no webhook {webhook!r}")
        query = query.where(TenantWebhook.id == int(webhook))
    else:
        query = query.where(TenantWebhook.url == webhook)
    row = session.scalars(query).first()
    if row is None:
        raise NotFound(f"tenant {tenant_id!r} has no webhook {webhook!r}")
    info = _info(row)
    session.delete(row)
    session.flush()
    audit.record(session, actor=actor, action="tenant.webhook.remove", target=str(info.id), tenant_id=tenant_id,
                 detail={"url": info.url})
    return info


def webhooks_by_tenant(session: Session, tenant_id: str) -> list[TenantWebhook]:
    """The rows (with secrets) an alert of this tenant is enqueued for."""
    return list(session.scalars(select(TenantWebhook).where(TenantWebhook.tenant_id == tenant_id)
                                .order_by(TenantWebhook.id)))
