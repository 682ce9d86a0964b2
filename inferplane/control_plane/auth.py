"""API keys: creation, listing, revocation, and verification from memory through `KeyCache`.

A key reads `ip_<id>_<secret>`. The id (16 hex digits) is public and indexes the row; the secret
(43 alphanumerics, ~256 bits) is shown once and only its sha256 is stored. A plain sha256 is enough
because the secret is random and long: there is nothing for a slow hash to protect against that
brute force could find. Digests are compared with `hmac.compare_digest`.

The gateway never reads the database on the request path: `KeyCache` holds every live key in memory
and refreshes in the background (changes since the last refresh every `refresh_interval` seconds,
everything every `full_reload_interval`), so a key revoked on one replica is refused by all within
about two refresh intervals.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane import audit
from inferplane.control_plane.errors import Forbidden, InvalidInput, NotFound, Unauthenticated
from inferplane.control_plane.orm import ApiKey, Tenant, utcnow
from inferplane.control_plane.periodic import PeriodicThread
from inferplane.control_plane.tenants import validate_key_priority, validate_priority, validate_sequence_limit

log = logging.getLogger(__name__)

SCOPE_INFER = "infer"
SCOPE_MODELS_READ = "models:read"
SCOPE_ADMIN = "admin"
SCOPES = frozenset({SCOPE_INFER, SCOPE_MODELS_READ, SCOPE_ADMIN})
DEFAULT_SCOPES = (SCOPE_INFER, SCOPE_MODELS_READ)
CATCH_UP_INTERVAL_S = 0.1  # KeyCache.catch_up: the most often a request with an unknown key refreshes the cache

KEY_PREFIX = "ip_"
_KEY_RE = re.compile(r"^ip_([0-9a-f]{16})_([A-Za-z0-9]{43})$")
_SECRET_ALPHABET = string.ascii_letters + string.digits
# Compared against when the key id is unknown, so unknown and wrong keys take the same time.
_DUMMY_DIGEST = hashlib.sha256(b"inferplane-dummy").digest()


class AllTenants:
    """Marker for a platform-admin query over every tenant; passed instead of a tenant id.

    A distinct object rather than `None`, so a forgotten tenant id can never widen a query by accident.
    """

    _instance: AllTenants | None = None

    def __new__(cls) -> AllTenants:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ALL_TENANTS"


ALL_TENANTS = AllTenants()
TenantScope = str | AllTenants


@dataclass(frozen=True)
class Principal:
    """Who is calling: `tenant_id` None means a platform admin (JWT or bootstrap key).

    A key's principal carries everything the request path decides with (limits, bands), read from
    the key cache, so admitting a request never touches the database.
    """

    subject: str
    tenant_id: str | None
    scopes: frozenset[str]
    via: str  # "key" | "jwt" | "bootstrap"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    # Priority bands (api/priority.py), each None when unset: the key's may lower its tenant's, never
    # raise it (priority.resolve_band).
    priority: str | None = None
    tenant_priority: str | None = None
    # Sequences in flight at once: this key's, and all of its tenant's keys' together (None: no limit).
    max_concurrent_sequences: int | None = None
    tenant_max_concurrent_sequences: int | None = None

    @property
    def key_id(self) -> str | None:
        return self.subject.removeprefix("key:") if self.via == "key" else None

    @property
    def actor(self) -> str:
        """The audit log's name for this caller."""
        return self.subject

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise Forbidden(f"this credential lacks the {scope!r} scope")


@dataclass(frozen=True)
class KeyInfo:
    """A key as listed: everything except the secret and its hash."""

    id: str
    tenant_id: str
    name: str | None
    scopes: tuple[str, ...]
    requests_per_minute: int | None
    tokens_per_minute: int | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    priority: str | None = None
    max_concurrent_sequences: int | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > utcnow())


@dataclass(frozen=True)
class CreatedKey:
    """The result of `create_key`: `secret` (the full `ip_...` string) exists only here, once."""

    secret: str
    info: KeyInfo


def _key_info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        name=row.name,
        scopes=tuple(row.scopes.split()),
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
        priority=row.priority,
        max_concurrent_sequences=row.max_concurrent_sequences,
    )


def parse_scopes(scopes: str | Iterable[str]) -> tuple[str, ...]:
    """Accepts "infer,models:read", "infer models:read" or a list; rejects unknown scopes."""
    items = scopes.replace(",", " ").split() if isinstance(scopes, str) else list(scopes)
    unknown = sorted(set(items) - SCOPES)
    if unknown:
        raise InvalidInput(f"unknown scope(s) {', '.join(unknown)}; known: {', '.join(sorted(SCOPES))}")
    if not items:
        raise InvalidInput("a key needs at least one scope")
    return tuple(sorted(set(items)))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_key(presented: str) -> tuple[str, str]:
    """Splits `ip_<id>_<secret>` into (id, secret); raises `Unauthenticated` if it is not that shape."""
    match = _KEY_RE.match(presented or "")
    if match is None:
        raise Unauthenticated("malformed API key (expected ip_<id>_<secret>)")
    return match.group(1), match.group(2)


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise InvalidInput(f"{name} must be a positive integer or unset, got {value!r}")
    return value


def _within_ceiling(name: str, value: int | None, ceiling: int | None, tenant_id: str) -> int | None:
    """A key's limit under its tenant's ceiling: unset takes the ceiling, above it is refused."""
    if ceiling is None:
        return value
    if value is None:
        return ceiling
    if value > ceiling:
        raise InvalidInput(f"{name}: at most {ceiling} for tenant {tenant_id!r} (its key ceiling), got {value}")
    return value


def _capped(value: int | None, ceiling: int | None) -> int | None:
    return ceiling if value is None else value if ceiling is None else min(value, ceiling)


def create_key(
    session: Session,
    tenant_id: str,
    *,
    actor: str,
    scopes: str | Iterable[str] = DEFAULT_SCOPES,
    name: str | None = None,
    expires_in: timedelta | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    priority: str | None = None,
    max_concurrent_sequences: int | None = None,
) -> CreatedKey:
    """Creates a key for `tenant_id` (NotFound if no such tenant); the secret is returned only here.

    `priority`: the key's band (None: its tenant's); not more urgent than its tenant's (a 400 naming
    `priority`, whoever the actor). `max_concurrent_sequences`: the key's own limit
    on sequences in flight; not above its tenant's (which holds for all its keys together anyway).
    """
    scope_tuple = parse_scopes(scopes)
    _positive_or_none("requests_per_minute", requests_per_minute)
    _positive_or_none("tokens_per_minute", tokens_per_minute)
    validate_priority(priority)
    validate_sequence_limit(max_concurrent_sequences)
    if expires_in is not None and expires_in <= timedelta(0):
        raise InvalidInput("a key's lifetime must be positive")
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    requests_per_minute = _within_ceiling("requests_per_minute", requests_per_minute,
                                          tenant.key_requests_per_minute_max, tenant_id)
    tokens_per_minute = _within_ceiling("tokens_per_minute", tokens_per_minute, tenant.key_tokens_per_minute_max,
                                        tenant_id)
    validate_key_priority(priority, tenant.priority, tenant_id)
    if max_concurrent_sequences is not None and tenant.max_concurrent_sequences is not None \
            and max_concurrent_sequences > tenant.max_concurrent_sequences:
        raise InvalidInput(f"max_concurrent_sequences: at most {tenant.max_concurrent_sequences} for tenant "
                           f"{tenant_id!r} (its own limit), got {max_concurrent_sequences}",
                           param="max_concurrent_sequences")
    key_id = secrets.token_hex(8)
    secret = "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(43))
    now = utcnow()
    row = ApiKey(
        id=key_id,
        tenant_id=tenant_id,
        name=name,
        secret_hash=hash_secret(secret),
        scopes=" ".join(scope_tuple),
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        priority=priority,
        max_concurrent_sequences=max_concurrent_sequences,
        created_at=now,
        updated_at=now,
        expires_at=now + expires_in if expires_in is not None else None,
    )
    session.add(row)
    session.flush()
    audit.record(
        session,
        actor=actor,
        action="key.create",
        target=key_id,
        tenant_id=tenant_id,
        detail={
            "scopes": list(scope_tuple),
            "expires_at": row.expires_at.isoformat() if row.expires_at else None,
            "priority": priority,
            "max_concurrent_sequences": max_concurrent_sequences,
        },
    )
    return CreatedKey(secret=f"{KEY_PREFIX}{key_id}_{secret}", info=_key_info(row))


def _owned_key(session: Session, key_id: str, tenant: TenantScope) -> ApiKey:
    row = session.get(ApiKey, key_id)
    # Another tenant's key is "not found", not "forbidden": its existence is not the caller's business.
    if row is None or (tenant is not ALL_TENANTS and row.tenant_id != tenant):
        raise NotFound(f"API key {key_id!r} not found")
    return row


def list_keys(session: Session, tenant: TenantScope, *, include_revoked: bool = True) -> list[KeyInfo]:
    """Keys of one tenant (or every tenant with `ALL_TENANTS`), oldest first, without secrets."""
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant is not ALL_TENANTS:
        query = query.where(ApiKey.tenant_id == tenant)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return [_key_info(r) for r in session.scalars(query)]


def get_key(session: Session, key_id: str, tenant: TenantScope) -> KeyInfo:
    return _key_info(_owned_key(session, key_id, tenant))


def revoke_key(session: Session, key_id: str, tenant: TenantScope, *, actor: str) -> KeyInfo:
    """Revokes a key (idempotent: revoking twice keeps the first time). Caches drop it on refresh."""
    row = _owned_key(session, key_id, tenant)
    if row.revoked_at is None:
        now = utcnow()
        row.revoked_at = now
        row.updated_at = now
        session.flush()
        audit.record(session, actor=actor, action="key.revoke", target=key_id, tenant_id=row.tenant_id)
    return _key_info(row)


# --- verification ---


@dataclass(frozen=True)
class _CachedKey:
    id: str
    tenant_id: str
    digest: bytes
    scopes: frozenset[str]
    expires_at: float | None  # epoch seconds
    requests_per_minute: int | None
    tokens_per_minute: int | None
    priority: str | None = None
    max_concurrent_sequences: int | None = None


@dataclass(frozen=True)
class _CachedTenant:
    """What the key cache keeps of a tenant: its keys' ceilings and its flow control."""

    key_requests_per_minute_max: int | None = None
    key_tokens_per_minute_max: int | None = None
    priority: str | None = None
    max_concurrent_sequences: int | None = None


# Who holds the bootstrap admin key (and a console session signed in with it).
BOOTSTRAP_PRINCIPAL = Principal(subject="bootstrap", tenant_id=None, scopes=SCOPES, via="bootstrap")


def verify_bootstrap_key(presented: str, configured: str | None) -> Principal:
    """Checks the bootstrap admin key (from the gateway's config) in constant time.

    Both sides are hashed first so `compare_digest` sees equal lengths and the length of the
    configured key does not leak through timing.
    """
    if not configured:
        raise Unauthenticated("no bootstrap admin key is configured")
    a = hashlib.sha256(presented.encode()).digest()
    b = hashlib.sha256(configured.encode()).digest()
    if not hmac.compare_digest(a, b):
        raise Unauthenticated("invalid admin credential")
    return BOOTSTRAP_PRINCIPAL


class KeyCache:
    """Verifies API keys from memory; a background thread keeps it in step with the database.

    Use: `cache = KeyCache(sessions); cache.start()` (loads everything once, synchronously, so the
    first request does not see an empty cache), then `cache.verify(key, scope)` per request, and
    `cache.stop()` at shutdown (it also writes pending `last_used_at`). `refresh()` may be called
    directly (tests, or a gateway that prefers its own scheduler).

    A key created on another replica becomes valid here after at most one refresh interval; a key
    revoked anywhere stops working here after at most one interval. If the database is unreachable the
    cache keeps serving what it has (and logs), which keeps inference up during a database outage at
    the cost of not seeing revocations until it is back.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        refresh_interval: float = 1.0,
        full_reload_interval: float = 60.0,
        overlap: timedelta = timedelta(seconds=30),
        clock: Callable[[], float] = time.time,
    ):
        self._sessions = sessions
        self.refresh_interval = refresh_interval
        self.full_reload_interval = full_reload_interval
        # Rows are re-read this far behind the newest `updated_at` seen: a writer's transaction may
        # commit after a later-stamped one, and replicas' clocks differ a little.
        self._overlap = overlap
        self._clock = clock
        self._keys: dict[str, _CachedKey] = {}
        # Each tenant's key ceilings (keys made before a ceiling obey it too) and flow control.
        self._tenants: dict[str, _CachedTenant] = {}
        self._watermark: datetime | None = None
        self._last_full = float("-inf")
        self._used: dict[str, float] = {}
        self._lock = threading.Lock()
        self._catching_up = None  # the refresh requests with unknown keys wait on (catch_up)
        self._last_catch_up = float("-inf")
        self.catch_ups = 0  # refreshes catch_up ran
        self._loop = PeriodicThread("inferplane-key-cache", lambda: self.refresh_interval, self.refresh,
                                    "API key cache refresh failed; serving the cached keys")

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def database_ok(self) -> bool:
        """False while the latest refresh failed: the one database read every gateway does each second."""
        return not self._loop.failing

    def __enter__(self) -> KeyCache:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.refresh(full=True)
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        self._flush_last_used()

    def refresh(self, *, full: bool | None = None) -> None:
        """Reads changed keys (or all of them) and drops keys of deleted tenants."""
        now = self._clock()
        if full is None:
            full = self._watermark is None or now - self._last_full >= self.full_reload_interval
        with self._sessions() as session:
            query = select(ApiKey)
            if not full:
                query = query.where(ApiKey.updated_at >= self._watermark - self._overlap)
            rows = list(session.scalars(query))
            tenants = {t.id: _CachedTenant(t.key_requests_per_minute_max, t.key_tokens_per_minute_max, t.priority,
                                           t.max_concurrent_sequences)
                       for t in session.execute(select(Tenant.id, Tenant.key_requests_per_minute_max,
                                                       Tenant.key_tokens_per_minute_max, Tenant.priority,
                                                       Tenant.max_concurrent_sequences))}
        fresh = {r.id: self._cached(r) for r in rows if r.revoked_at is None}
        gone = {r.id for r in rows if r.revoked_at is not None}
        newest = max((r.updated_at for r in rows), default=None)
        with self._lock:
            if full:
                keys = fresh
            else:
                keys = dict(self._keys)
                for key_id in gone:
                    keys.pop(key_id, None)
                keys.update(fresh)
            self._keys = {k: v for k, v in keys.items() if v.tenant_id in tenants}
            self._tenants = tenants
            if newest is not None and (self._watermark is None or newest > self._watermark):
                self._watermark = newest
            if self._watermark is None:
                self._watermark = utcnow()
            if full:
                self._last_full = now
        self._flush_last_used()

    @staticmethod
    def _cached(row: ApiKey) -> _CachedKey:
        return _CachedKey(
            id=row.id,
            tenant_id=row.tenant_id,
            digest=bytes.fromhex(row.secret_hash),
            scopes=frozenset(row.scopes.split()),
            expires_at=row.expires_at.timestamp() if row.expires_at else None,
            requests_per_minute=row.requests_per_minute,
            tokens_per_minute=row.tokens_per_minute,
            priority=row.priority,
            max_concurrent_sequences=row.max_concurrent_sequences,
        )

    def verify(self, presented: str, scope: str | None = None) -> Principal:
        """Returns who holds `presented`; `Unauthenticated` (401) if not a live key, `Forbidden` (403)
        if it lacks `scope`. Never touches the database."""
        key_id, secret = parse_key(presented)
        cached = self._keys.get(key_id)
        digest = hashlib.sha256(secret.encode()).digest()
        ok = hmac.compare_digest(digest, cached.digest if cached else _DUMMY_DIGEST)
        if cached is None or not ok:
            raise Unauthenticated("invalid API key")
        now = self._clock()
        if cached.expires_at is not None and now >= cached.expires_at:
            raise Unauthenticated("API key expired")
        if scope is not None and scope not in cached.scopes:
            raise Forbidden(f"this API key lacks the {scope!r} scope")
        self._used[key_id] = now
        return self._principal(cached)

    def unknown(self, presented: str | None) -> bool:
        """Whether `presented` is shaped like a key whose id this cache does not hold (yet): one
        made elsewhere since the last refresh, or no key at all."""
        try:
            key_id, _ = parse_key(presented or "")
        except Unauthenticated:
            return False
        return key_id not in self._keys

    async def catch_up(self) -> None:
        """One refresh now, off the event loop, for a request whose key this cache does not hold:
        a key made a moment ago (`inferplane keys create` writes the database, not this gateway)
        works at once instead of after the next refresh. Requests waiting at the same time share one
        refresh, and refreshes for unknown keys start at most every CATCH_UP_INTERVAL_S, so a
        flood of made-up keys costs the database a few small reads a second, never the loop."""
        if self._catching_up is None or self._catching_up.done():
            async def refresh() -> None:
                wait = self._last_catch_up + CATCH_UP_INTERVAL_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._last_catch_up = time.monotonic()
                self.catch_ups += 1
                await asyncio.to_thread(self.refresh, full=False)

            self._catching_up = asyncio.ensure_future(refresh())
        try:
            await asyncio.shield(self._catching_up)
        except Exception:  # the database is away: the request is refused as it would have been
            log.warning("refreshing the key cache for an unknown key failed", exc_info=True)

    def principal_of(self, key_id: str) -> Principal:
        """Who holds key `key_id`, while it is live: what a console session signed in with that key
        acts as (gateway/console/sessions.py), so revoking or expiring the key ends its sessions
        within a refresh interval. `Unauthenticated` (401) once it is not."""
        cached = self._keys.get(key_id)
        if cached is None:
            raise Unauthenticated("the API key this session signed in with is revoked or gone")
        if cached.expires_at is not None and self._clock() >= cached.expires_at:
            raise Unauthenticated("the API key this session signed in with has expired")
        return self._principal(cached)

    def _principal(self, cached: _CachedKey) -> Principal:
        tenant = self._tenants.get(cached.tenant_id) or _CachedTenant()
        return Principal(
            subject=f"key:{cached.id}",
            tenant_id=cached.tenant_id,
            scopes=cached.scopes,
            via="key",
            requests_per_minute=_capped(cached.requests_per_minute, tenant.key_requests_per_minute_max),
            tokens_per_minute=_capped(cached.tokens_per_minute, tenant.key_tokens_per_minute_max),
            priority=cached.priority,
            tenant_priority=tenant.priority,
            max_concurrent_sequences=cached.max_concurrent_sequences,
            tenant_max_concurrent_sequences=tenant.max_concurrent_sequences,
        )

    def _flush_last_used(self) -> None:
        """Writes `last_used_at` for keys used since the last write, in one transaction."""
        used, self._used = self._used, {}
        if not used:
            return
        try:
            with self._sessions.begin() as session:
                for key_id, at in used.items():
                    stamp = datetime.fromtimestamp(at, tz=utcnow().tzinfo)
                    session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=stamp))
        except Exception:
            log.exception("could not record API key last use")
