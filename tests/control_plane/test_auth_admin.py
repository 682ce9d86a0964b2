"""`authenticate_admin`: bootstrap key, tenant-admin API keys and JWTs behind one entry point."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.auth import KeyCache, create_key
from inferplane.control_plane.errors import Forbidden, Unauthenticated
from inferplane.control_plane.tokens import AdminTokenVerifier, JWTSettings, authenticate_admin, issue_token

SECRET = "s" * 40
BOOTSTRAP = "bootstrap-admin-key-for-tests"


def test_admin_credentials(sessions: sessionmaker[Session], two_tenants: tuple[str, str]) -> None:
    with sessions.begin() as s:
        admin_key = create_key(s, "acme", actor="t", scopes="admin").secret
        infer_key = create_key(s, "acme", actor="t", scopes="infer").secret
    cache = KeyCache(sessions)
    cache.refresh()
    verifier = AdminTokenVerifier(JWTSettings("HS256", SECRET))
    auth = {"jwt_verifier": verifier, "bootstrap_key": BOOTSTRAP, "key_cache": cache}

    platform = authenticate_admin(BOOTSTRAP, **auth)
    assert (platform.via, platform.tenant_id) == ("bootstrap", None)
    tenant_admin = authenticate_admin(admin_key, **auth)
    assert (tenant_admin.via, tenant_admin.tenant_id) == ("key", "acme")  # scoped to its tenant
    jwt_admin = authenticate_admin(issue_token(SECRET, algorithm="HS256", subject="ops"), **auth)
    assert (jwt_admin.via, jwt_admin.actor) == ("jwt", "jwt:ops")

    with pytest.raises(Forbidden):
        authenticate_admin(infer_key, **auth)
    with pytest.raises(Forbidden):
        authenticate_admin(issue_token(SECRET, algorithm="HS256", subject="ro", scopes="models:read"), **auth)
    for bad in ("wrong", BOOTSTRAP + "x", ""):
        with pytest.raises(Unauthenticated):
            authenticate_admin(bad, **auth)
    with pytest.raises(Unauthenticated):  # no key cache configured: keys are not admin credentials
        authenticate_admin(admin_key, bootstrap_key=BOOTSTRAP)
    with pytest.raises(Unauthenticated):  # nothing configured accepts anything
        authenticate_admin(BOOTSTRAP)
