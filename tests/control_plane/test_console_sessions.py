"""Issue 58: console sessions through the gateway's whole ASGI app (fast path included).

A credential is exchanged once for an HttpOnly, SameSite=Strict session cookie; the cookie then
stands in for the credential only together with the session's CSRF header, with exactly the
credential's rights, and ends with sign-out, with the key's revocation, or with a changed admin key.
The browser-level checks (a real Chromium) are in tests/console/.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.console.sessions import COOKIE_NAME, ConsoleSessions
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.orm import Usage
from tests.control_plane.fake_worker import RecordingWorker, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")
ADMIN = "ipadmin_console-test-bootstrap-key"


@pytest.fixture
def gateway(tmp_path):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=ADMIN))
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t")
        tenants.create_tenant(s, "globex", actor="t")
        gw.admin_key = auth.create_key(s, "acme", actor="t", scopes="infer models:read admin").secret
        gw.infer_key = auth.create_key(s, "acme", actor="t", scopes="infer models:read").secret
        gw.other_key = auth.create_key(s, "globex", actor="t", scopes="infer models:read admin").secret
    gw.keys.refresh()
    with gw.sessions.begin() as s:  # usage the platform admin sums across tenants
        s.add_all([Usage(tenant_id="acme", model="m", minute=datetime.now(UTC).replace(second=0, microsecond=0)
                         - timedelta(minutes=i), requests=1, prompt_tokens=3, completion_tokens=4) for i in range(2)])
    yield gw
    gw.engine.dispose()


def client(gw: Gateway, base_url: str = "http://gw") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(create_asgi_app(gw.context)), base_url=base_url, timeout=30)


async def sign_in(http: httpx.AsyncClient, credential: str, **headers) -> dict:
    answer = await http.post("/console/api/session", json={"key": credential}, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_sign_in_sets_a_strict_http_only_cookie_that_holds_no_secret(gateway) -> None:
    async with client(gateway) as http:
        answer = await http.post("/console/api/session", json={"key": gateway.admin_key})
        assert answer.status_code == 200, answer.text
        cookie = answer.headers["set-cookie"]
        attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
        assert {"httponly", "path", "max-age"} <= attributes and "samesite=strict" in cookie.lower()
        assert "secure" not in attributes  # plain http on loopback: a Secure cookie would never come back
        token = http.cookies[COOKIE_NAME]
        secret = gateway.admin_key.split("_", 2)[-1]
        assert secret not in token and secret not in answer.text  # the session names the key, never holds it
        info = answer.json()
        assert (info["role"], info["tenant"]) == ("tenant", "acme") and "admin" in info["scopes"]
        again = await http.get("/console/api/session")  # a reloaded page gets its CSRF token back
        assert again.json()["csrf"] == info["csrf"]
        assert again.headers["cache-control"] == "no-store"
    async with client(gateway, "https://gw") as http:  # behind TLS the cookie is Secure
        answer = await http.post("/console/api/session", json={"key": gateway.admin_key})
        assert "secure" in {p.strip().lower() for p in answer.headers["set-cookie"].split(";")}


async def test_the_cookie_needs_its_csrf_header_everywhere(gateway, tokenizer) -> None:
    worker = RecordingWorker(tokenizer)
    server, address = await serve(worker)
    try:
        route_to(gateway, address, tokenizer)
        async with client(gateway) as http:
            info = await sign_in(http, gateway.admin_key)
            csrf = {"x-csrf-token": info["csrf"]}
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            for method, path, payload in (("GET", "/v1/usage", None), ("GET", "/admin/v1/keys", None),
                                          ("POST", "/admin/v1/keys", {"name": "x"}),
                                          ("POST", "/v1/completions", body)):
                for headers in ({}, {"x-csrf-token": "forged"}):
                    refused = await http.request(method, path, json=payload, headers=headers)
                    assert refused.status_code == 403, (method, path, refused.text)
                    assert "X-CSRF-Token" in refused.text
            with gateway.sessions.begin() as s:  # the refused key creation created nothing
                assert [k.name for k in auth.list_keys(s, "acme")].count("x") == 0
            assert worker.requests == []  # nor did the refused completion reach a worker
            assert (await http.post("/v1/completions", json=body, headers=csrf)).status_code == 200
            created = await http.post("/admin/v1/keys", json={"name": "x", "scopes": ["infer"]}, headers=csrf)
            assert created.status_code == 201 and created.json()["tenant_id"] == "acme"
    finally:
        await server.stop(None)


async def test_rights_are_exactly_the_credentials(gateway) -> None:
    async with client(gateway) as http:  # a tenant admin: its own tenant only, no operator pages
        csrf = {"x-csrf-token": (await sign_in(http, gateway.admin_key))["csrf"]}
        for path in ("/admin/v1/tenants", "/admin/v1/usage", "/console/api/deployments", "/console/api/health",
                     "/admin/v1/keys?tenant_id=globex", "/admin/v1/tenants/globex/webhooks"):
            assert (await http.get(path, headers=csrf)).status_code == 403, path
        keys = (await http.get("/admin/v1/keys", headers=csrf)).json()["data"]
        assert {k["tenant_id"] for k in keys} == {"acme"}
    async with client(gateway) as http:  # an infer-only key: the playground and its usage, no keys
        csrf = {"x-csrf-token": (await sign_in(http, gateway.infer_key))["csrf"]}
        assert (await http.get("/admin/v1/keys", headers=csrf)).status_code == 403
        assert (await http.get("/v1/usage", headers=csrf)).status_code == 200
    async with client(gateway) as http:  # the platform admin: operator pages, no tenant inference
        info = await sign_in(http, ADMIN)
        assert (info["role"], info["tenant"]) == ("platform-admin", None)
        csrf = {"x-csrf-token": info["csrf"]}
        listed = (await http.get("/admin/v1/tenants", headers=csrf)).json()["data"]
        assert {t["id"] for t in listed} >= {"acme", "globex"}
        assert (await http.get("/console/api/deployments", headers=csrf)).status_code == 200
        across = (await http.get("/admin/v1/usage", headers=csrf)).json()["data"]
        assert [t["tenant_id"] for t in across] == ["acme"] and across[0]["requests"] == 2
        health = (await http.get("/console/api/health", headers=csrf)).json()["components"]
        assert {c["component"] for c in health} >= {"gateway", "database", "workers"}
        refused = await http.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=csrf)
        assert refused.status_code == 403


async def test_sessions_end(gateway, tmp_path) -> None:
    async with client(gateway) as http:  # sign-out: the same cookie is refused afterwards
        csrf = {"x-csrf-token": (await sign_in(http, gateway.infer_key))["csrf"]}
        token = http.cookies[COOKIE_NAME]
        out = await http.delete("/console/api/session", headers=csrf)
        assert out.status_code == 200 and COOKIE_NAME not in http.cookies
        http.cookies.set(COOKIE_NAME, token)
        assert (await http.get("/v1/usage", headers=csrf)).status_code == 401
    async with client(gateway) as http:  # the key revoked: its session ends with it
        csrf = {"x-csrf-token": (await sign_in(http, gateway.infer_key))["csrf"]}
        key_id = auth.parse_key(gateway.infer_key)[0]
        with gateway.sessions.begin() as s:
            auth.revoke_key(s, key_id, "acme", actor="t")
        gateway.keys.refresh()
        answer = await http.get("/v1/usage", headers=csrf)
        assert answer.status_code == 401 and "revoked" in answer.text
    async with client(gateway) as http:  # a tampered token is refused
        await sign_in(http, gateway.other_key)
        token = http.cookies[COOKIE_NAME]
        http.cookies.set(COOKIE_NAME, token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB"))
        assert (await http.get("/console/api/session")).status_code == 401
    # a changed admin key ends the sessions signed in with the old one
    sessions = ConsoleSessions(b"s" * 32, gateway.keys, bootstrap_key=ADMIN)
    token, info = sessions.sign_in(ADMIN)
    assert sessions.principal(token, info.csrf)[0].via == "bootstrap"
    sessions.bootstrap_key = ADMIN + "-rotated"
    with pytest.raises(auth.Unauthenticated):
        sessions.principal(token, info.csrf)
    other = ConsoleSessions(b"t" * 32, gateway.keys, bootstrap_key=ADMIN)  # another secret: not its session
    with pytest.raises(auth.Unauthenticated):
        other.principal(token, info.csrf)


async def test_sign_in_refuses_other_origins_forms_and_bad_credentials(gateway) -> None:
    async with client(gateway) as http:
        cross = await http.post("/console/api/session", json={"key": gateway.admin_key},
                                headers={"origin": "http://evil.example"})
        assert cross.status_code == 403 and "Origin" in cross.text and COOKIE_NAME not in http.cookies
        form = await http.post("/console/api/session", data={"key": gateway.admin_key})
        assert form.status_code in (400, 415, 422) and COOKIE_NAME not in http.cookies
        for bad in ("ip_nope_nope", "wrong", ADMIN + "x"):
            answer = await http.post("/console/api/session", json={"key": bad})
            assert answer.status_code == 401, (bad, answer.text)
        missing = await http.post("/console/api/session", json={})
        assert missing.status_code == 422 and "key" in missing.text
        same = await http.post("/console/api/session", json={"key": gateway.admin_key},
                               headers={"origin": "http://gw"})
        assert same.status_code == 200


async def test_pages_and_docs_are_served_from_the_package(gateway) -> None:
    async with client(gateway) as http:
        root = await http.get("/")
        assert root.status_code == 307 and root.headers["location"] == "/console/"
        page = await http.get("/console/")
        assert page.status_code == 200 and "console.js" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
        for asset in ("console.js", "console.css", "vendor/uplot/uPlot.iife.min.js"):
            assert (await http.get(f"/console/static/{asset}")).status_code == 200, asset
        assert (await http.get("/console/static/../sessions.py")).status_code == 404
        docs = await http.get("/docs")
        assert docs.status_code == 200 and "cdn" not in docs.text.lower()
        scripts = [part.split('"')[1] for part in docs.text.split("src=")[1:]]
        assert scripts and all(s.startswith("/") for s in scripts)
        for script in scripts:
            assert (await http.get(script)).status_code == 200, script
