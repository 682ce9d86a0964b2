"""Issue 13, item 5: the admin API confines registration, and a tenant cannot squat platform names.

Before, a tenant's admin key registering `{"source": "/etc/shadow"}` made the gateway (root) open the
file and answer "is neither a GGUF file…", while other paths answered "no such model file": an
oracle for the server's file system. Tenants could also register public models and take platform
names.
"""

from __future__ import annotations

import os

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

BOOTSTRAP = "ipadmin_" + "b" * 40


@pytest.fixture
def gateway(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=BOOTSTRAP,
                                 model_roots=(str(root),)))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t1", actor="test")
        gw.tenant_admin = auth.create_key(session, "t1", actor="test", scopes=["infer", "admin"]).secret
    gw.keys.refresh()
    gw.root = root
    yield gw
    gw.engine.dispose()


async def register(gw: Gateway, key: str, **body) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/admin/v1/models", json=body, headers={"authorization": f"Bearer {key}"})


def message(response: httpx.Response, source: str) -> str:
    return response.json()["error"]["message"].replace(repr(source), "<source>")


async def test_a_tenant_admin_cannot_register_server_paths_and_learns_nothing_about_them(gateway):
    answers = {path: await register(gateway, gateway.tenant_admin, source=path)
               for path in ("/etc/shadow", "/etc/passwd", "/no/such/file.gguf", str(gateway.root / "x.gguf"))}
    assert {a.status_code for a in answers.values()} == {403}
    assert len({message(a, path) for path, a in answers.items()}) == 1  # one answer, whatever the path
    assert "alias" in message(answers["/etc/shadow"], "/etc/shadow")


async def test_a_tenant_admin_registers_private_aliases_only(gateway):
    public = await register(gateway, gateway.tenant_admin, source="smollm2-135m", name="mine", visibility="public")
    assert public.status_code == 403 and "platform" in public.json()["error"]["message"]
    private = await register(gateway, gateway.tenant_admin, source="smollm2-135m", name="mine")
    assert private.status_code == 201, private.text
    assert private.json()["visibility"] == "private" and private.json()["owner_tenant_id"] == "t1"


async def test_the_platform_admin_registers_only_inside_the_model_roots(gateway, make_gguf, tmp_path):
    inside = make_gguf(gateway.root / "tiny.gguf")
    assert (await register(gateway, BOOTSTRAP, source=str(inside))).status_code == 201
    os.symlink("/etc/passwd", gateway.root / "escape.gguf")  # a link inside a root may not lead out
    outside = {path: await register(gateway, BOOTSTRAP, source=path)
               for path in ("/etc/shadow", "/no/such/file.gguf", str(gateway.root / "escape.gguf"),
                            f"file://{tmp_path}/gw.db", str(gateway.root / ".." / "gw.db"))}
    assert {a.status_code for a in outside.values()} == {403}, {p: a.text for p, a in outside.items()}
    assert len({message(a, path) for path, a in outside.items()}) == 1
    relative = await register(gateway, BOOTSTRAP, source="tiny.gguf")
    assert relative.status_code == 400 and "absolute" in relative.json()["error"]["message"]


async def test_registration_records_the_kind_and_refuses_an_unsupported_architecture(gateway, make_gguf):
    gemma = await register(gateway, BOOTSTRAP, source=str(make_gguf(gateway.root / "gemma.gguf", arch="gemma3")))
    assert gemma.status_code == 201, gemma.text
    assert (gemma.json()["architecture"], gemma.json()["kind"]) == ("gemma3", "generate")
    gpt2 = await register(gateway, BOOTSTRAP, source=str(make_gguf(gateway.root / "gpt2.gguf", arch="gpt2")))
    assert gpt2.status_code == 400, gpt2.text
    error = gpt2.json()["error"]
    assert "architecture 'gpt2' is not supported" in error["message"]
    assert (error["code"], error["param"]) == ("unsupported_architecture", "source")
    listed = await admin_call(gateway, "GET", "/admin/v1/models", BOOTSTRAP)
    assert [(m["name"], m["kind"]) for m in listed.json()["data"]] == [("gemma", "generate")]


async def test_a_tenant_name_never_blocks_the_platform(gateway, make_gguf):
    assert (await register(gateway, gateway.tenant_admin, source="smollm2-135m", name="gpt-5")).status_code == 201
    platform = await register(gateway, BOOTSTRAP, source=str(make_gguf(gateway.root / "p.gguf")), name="gpt-5")
    assert platform.status_code == 201, platform.text  # was 409: the tenant had squatted the name
    squat = await register(gateway, gateway.tenant_admin, source="smollm2-135m", name="gpt-5", version="2")
    assert squat.status_code == 201  # a version of the tenant's own gpt-5; the platform's stays apart
    again = await register(gateway, BOOTSTRAP, source=str(make_gguf(gateway.root / "q.gguf", seed=1)), name="x")
    assert again.status_code == 201
    taken = await register(gateway, gateway.tenant_admin, source="smollm2-135m", name="x")
    assert taken.status_code == 409  # a platform name is not the tenant's to take


async def admin_call(gw: Gateway, method: str, path: str, key: str, **body) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.request(method, path, json=body, headers={"authorization": f"Bearer {key}"})


async def test_a_tenant_admin_cannot_mint_keys_above_the_tenants_ceiling(gateway):
    """Issue 13, item 8: a tenant admin could mint keys with no limits at all."""
    old = (await admin_call(gateway, "POST", "/admin/v1/keys", gateway.tenant_admin)).json()["key"]  # unlimited
    patched = await admin_call(gateway, "PATCH", "/admin/v1/tenants/t1", BOOTSTRAP,
                               key_requests_per_minute_max=100, key_tokens_per_minute_max=5000)
    assert patched.status_code == 200 and patched.json()["key_tokens_per_minute_max"] == 5000
    assert (await admin_call(gateway, "PATCH", "/admin/v1/tenants/t1", gateway.tenant_admin,
                             key_tokens_per_minute_max=10**9)).status_code == 403  # the platform's to set
    above = await admin_call(gateway, "POST", "/admin/v1/keys", gateway.tenant_admin, tokens_per_minute=6000)
    assert above.status_code == 400 and "tokens_per_minute" in above.json()["error"]["message"]
    unset = await admin_call(gateway, "POST", "/admin/v1/keys", gateway.tenant_admin)
    assert unset.status_code == 201
    assert (unset.json()["requests_per_minute"], unset.json()["tokens_per_minute"]) == (100, 5000)
    within = await admin_call(gateway, "POST", "/admin/v1/keys", gateway.tenant_admin, tokens_per_minute=10)
    assert within.json()["tokens_per_minute"] == 10
    # A key minted before the ceiling is held to it too.
    gateway.keys.refresh()
    principal = gateway.keys.verify(old)
    assert (principal.requests_per_minute, principal.tokens_per_minute) == (100, 5000)
    assert gateway.keys.verify(within.json()["key"]).tokens_per_minute == 10
    lifted = await admin_call(gateway, "PATCH", "/admin/v1/tenants/t1", BOOTSTRAP, key_tokens_per_minute_max=None)
    assert lifted.json()["key_tokens_per_minute_max"] is None and lifted.json()["key_requests_per_minute_max"] == 100
    assert gateway.keys.verify(old).tokens_per_minute is None
