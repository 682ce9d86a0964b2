"""API keys: shown once, stored hashed, verified from memory, revoked everywhere within seconds."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane import audit
from inferplane.control_plane.auth import (
    ALL_TENANTS,
    KeyCache,
    create_key,
    get_key,
    list_keys,
    revoke_key,
    verify_bootstrap_key,
)
from inferplane.control_plane.db import init_db, session_factory
from inferplane.control_plane.errors import Forbidden, InvalidInput, NotFound, Unauthenticated
from inferplane.control_plane.orm import ApiKey, utcnow
from inferplane.control_plane.tenants import create_tenant, delete_tenant, list_tenants

Sessions = sessionmaker[Session]


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _key(sessions: Sessions, tenant: str, **kwargs) -> str:
    with sessions.begin() as s:
        return create_key(s, tenant, actor="test", **kwargs).secret


def test_key_shape_and_only_the_hash_is_stored(sessions: Sessions, two_tenants: tuple[str, str]) -> None:
    with sessions.begin() as s:
        created = create_key(s, "acme", actor="test", name="ci")
    prefix, key_id, secret = created.secret.split("_", 2)
    assert prefix == "ip" and key_id == created.info.id and len(secret) == 43
    assert created.info.scopes == ("infer", "models:read")  # the default
    with sessions() as s:
        row = s.get(ApiKey, key_id)
        stored = " ".join(str(v) for v in s.execute(sa.select(ApiKey.__table__)).one())
    assert secret not in stored and row.secret_hash != secret and len(row.secret_hash) == 64
    # a second key differs in id and secret
    other = _key(sessions, "acme")
    assert other.split("_")[1] != key_id and other.split("_", 2)[2] != secret


def test_verify_through_cache(sessions: Sessions, two_tenants: tuple[str, str]) -> None:
    good = _key(sessions, "acme", scopes="infer", requests_per_minute=10)
    cache = KeyCache(sessions)
    cache.refresh()
    p = cache.verify(good, "infer")
    assert (p.tenant_id, p.scopes, p.via, p.requests_per_minute) == ("acme", frozenset({"infer"}), "key", 10)
    assert p.key_id == good.split("_")[1]
    with pytest.raises(Forbidden) as e:
        cache.verify(good, "admin")
    assert e.value.status == 403
    key_id, secret = good.split("_")[1], good.split("_", 2)[2]
    wrong = f"ip_{key_id}_{'A' * 43}"
    unknown = f"ip_{'0' * 16}_{secret}"
    for bad in (wrong, unknown, "", "Bearer x", good + "x", good.replace("ip_", "sk_"), good[:-1]):
        with pytest.raises(Unauthenticated) as e:
            cache.verify(bad)
        assert e.value.status == 401


def test_expired_key_is_refused(sessions: Sessions, two_tenants: tuple[str, str]) -> None:
    key = _key(sessions, "acme", expires_in=timedelta(hours=1))
    clock = Clock()
    cache = KeyCache(sessions, clock=clock)
    cache.refresh()
    cache.verify(key)
    clock.now += 3601
    with pytest.raises(Unauthenticated, match="expired"):
        cache.verify(key)


def test_bad_key_parameters(sessions: Sessions, two_tenants: tuple[str, str]) -> None:
    with sessions.begin() as s:
        with pytest.raises(InvalidInput, match="unknown scope"):
            create_key(s, "acme", actor="t", scopes="infer,root")
        with pytest.raises(InvalidInput):
            create_key(s, "acme", actor="t", scopes="")
        with pytest.raises(InvalidInput):
            create_key(s, "acme", actor="t", expires_in=timedelta(seconds=-1))
        with pytest.raises(InvalidInput):
            create_key(s, "acme", actor="t", requests_per_minute=0)
        with pytest.raises(NotFound):
            create_key(s, "nobody", actor="t")


def test_revocation_and_last_used(sessions: Sessions, two_tenants: tuple[str, str]) -> None:
    key = _key(sessions, "acme")
    key_id = key.split("_")[1]
    with sessions.begin() as s:  # an old key, outside the cache's re-read overlap window
        old = utcnow() - timedelta(days=3)
        s.execute(sa.update(ApiKey).where(ApiKey.id == key_id).values(created_at=old, updated_at=old))
    _key(sessions, "acme")  # a recent change moves the cache's watermark to now
    cache = KeyCache(sessions)
    cache.refresh()
    cache.verify(key)
    cache.refresh(full=False)  # writes last_used_at
    with sessions() as s:
        assert get_key(s, key_id, "acme").last_used_at is not None
    with sessions.begin() as s:
        first = revoke_key(s, key_id, "acme", actor="test").revoked_at
        assert revoke_key(s, key_id, "acme", actor="test").revoked_at == first  # idempotent
    cache.verify(key)  # not refreshed yet: still in memory
    cache.refresh(full=False)  # sees the revocation because revoking moved updated_at
    with pytest.raises(Unauthenticated):
        cache.verify(key)
    with sessions() as s:
        actions = [e.action for e in audit.list_entries(s, tenant_id="acme")]
    assert actions.count("key.revoke") == 1 and "key.create" in actions


def test_key_isolation_between_tenants(sessions: Sessions, two_tenants: tuple[str, str]) -> None:
    a_key = _key(sessions, "acme")
    _key(sessions, "globex")
    a_id = a_key.split("_")[1]
    with sessions() as s:
        assert [k.tenant_id for k in list_keys(s, "acme")] == ["acme"]
        assert [k.tenant_id for k in list_keys(s, "globex")] == ["globex"]
        assert len(list_keys(s, ALL_TENANTS)) == 2
        with pytest.raises(NotFound):
            get_key(s, a_id, "globex")
    with sessions.begin() as s:
        with pytest.raises(NotFound):
            revoke_key(s, a_id, "globex", actor="key:globex")
    with sessions() as s:
        assert get_key(s, a_id, "acme").revoked_at is None


def test_deleting_a_tenant_drops_its_keys_from_the_cache(
    sessions: Sessions, two_tenants: tuple[str, str]
) -> None:
    key = _key(sessions, "globex")
    cache = KeyCache(sessions)
    cache.refresh()
    cache.verify(key)
    with sessions.begin() as s:
        delete_tenant(s, "globex", actor="test")
    cache.refresh(full=False)  # incremental: the deleted rows are gone, not "changed"
    with pytest.raises(Unauthenticated):
        cache.verify(key)
    with sessions() as s:
        assert [t.id for t in list_tenants(s)] == ["acme"]
        assert list_keys(s, "globex") == []


def test_revoked_on_one_replica_refused_by_another_within_5s(db_url: str) -> None:
    """Two gateways = two engines and two caches with background refresh; revoke through a third
    connection and wait (bounded) until the second cache refuses the key."""
    engines = [init_db(db_url) for _ in range(3)]
    admin, *replicas = [session_factory(e) for e in engines]
    with admin.begin() as s:
        create_tenant(s, "acme", actor="test")
        key = create_key(s, "acme", actor="test").secret
        spare = create_key(s, "acme", actor="test").secret
    caches = [KeyCache(r, refresh_interval=0.2) for r in replicas]
    try:
        for c in caches:
            c.start()
            c.verify(key)
        with admin.begin() as s:
            revoke_key(s, key.split("_")[1], "acme", actor="test")
        deadline = time.monotonic() + 5.0
        refused = [False, False]
        while not all(refused) and time.monotonic() < deadline:
            for i, c in enumerate(caches):
                try:
                    c.verify(key)
                except Unauthenticated:
                    refused[i] = True
            time.sleep(0.05)
        assert refused == [True, True]
        # the other key keeps working, and a key created meanwhile appears too
        with admin.begin() as s:
            late = create_key(s, "acme", actor="test").secret
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                caches[1].verify(late)
                break
            except Unauthenticated:
                time.sleep(0.05)
        caches[1].verify(late)
        caches[1].verify(spare)
    finally:
        for c in caches:
            c.stop()
        for e in engines:
            e.dispose()


def test_bootstrap_key() -> None:
    p = verify_bootstrap_key("s3cret-bootstrap", "s3cret-bootstrap")
    assert p.tenant_id is None and "admin" in p.scopes and p.via == "bootstrap"
    for presented, configured in (
        ("nope", "s3cret-bootstrap"),
        ("", "s3cret-bootstrap"),
        ("x", None),
        ("x", ""),
    ):
        with pytest.raises(Unauthenticated):
            verify_bootstrap_key(presented, configured)
