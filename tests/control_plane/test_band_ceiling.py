"""Issue 53: a key's band may lower its tenant's, never raise it.

A tenant admin mints its own keys, so a key's band above its tenant's let a tenant the platform
admin had put in `batch` preempt every other tenant with a `critical` key. Refused where a key is
made (admin API, CLI, `auth.create_key`, whoever the caller) with a 400 naming `priority`, and
capped where a request's band is computed (`api.priority.resolve_band`), so rows written before the
check, or a tenant's band lowered after its keys were made, cannot escape either.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.api.priority import BANDS, resolve_band
from inferplane.cli import main
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.orm import ApiKey
from tests.control_plane.fake_worker import RecordingWorker, complete, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

BOOTSTRAP = "bootstrap-admin-key-for-tests"
# (key band, tenant band) pairs where the key would be more urgent than its tenant; an unset tenant
# band counts as the default (standard) when a key is made.
RAISING = [("critical", "standard"), ("critical", "batch"), ("standard", "batch"), ("critical", None)]
ALLOWED = [(k, t) for k in BANDS for t in (*BANDS, None)
           if (k, t) not in RAISING] + [(None, t) for t in (*BANDS, None)]


@pytest.mark.parametrize(("key", "tenant", "deployment", "band"), [
    ("critical", "batch", None, "batch"),  # the attack: capped at the tenant's band
    ("critical", "standard", "critical", "standard"),
    ("standard", "batch", "critical", "batch"),
    ("critical", None, None, "standard"),  # no tenant band: capped at what the tenant would get
    ("critical", None, "batch", "batch"),
    ("critical", None, "critical", "critical"),  # the deployment's band is the tenant's requests' anyway
    ("batch", "critical", None, "batch"),  # lowering is what a key's band is for
    ("standard", "critical", "batch", "standard"),
    (None, "batch", "critical", "batch"),  # unchanged: the tenant's over the deployment's
    (None, None, "critical", "critical"),
    (None, None, None, "standard"),
])
def test_the_effective_band_is_never_above_the_tenants(key, tenant, deployment, band) -> None:
    assert resolve_band(key, tenant, deployment) == band


@pytest.mark.parametrize(("key", "tenant"), RAISING)
def test_a_key_above_its_tenants_band_is_refused(sessions: sessionmaker[Session], key: str,
                                                 tenant: str | None) -> None:
    with sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t", priority=tenant)
        with pytest.raises(InvalidInput) as refused:
            auth.create_key(s, "acme", actor="t", priority=key)
    assert refused.value.param == "priority" and "priority" in str(refused.value)
    with sessions() as s:
        assert s.query(ApiKey).count() == 0


@pytest.mark.parametrize(("key", "tenant"), ALLOWED)
def test_a_key_at_or_below_its_tenants_band_is_made(sessions: sessionmaker[Session], key: str | None,
                                                    tenant: str | None) -> None:
    with sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t", priority=tenant)
        assert auth.create_key(s, "acme", actor="t", priority=key).info.priority == key


@pytest.fixture
def gateway(db_url: str):
    gw = Gateway(GatewaySettings(db_url=db_url, bootstrap_key=BOOTSTRAP))
    yield gw
    gw.engine.dispose()


async def _post_key(gw: Gateway, credential: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/admin/v1/keys", json=body, headers={"authorization": f"Bearer {credential}"})


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_neither_a_tenant_admin_nor_the_platform_admin_can_raise_a_keys_band(gateway: Gateway) -> None:
    with gateway.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t", priority="batch")
        tenant_admin = auth.create_key(s, "acme", actor="t", scopes="admin").secret
    gateway.keys.refresh()
    for credential, body in ((tenant_admin, {}), (BOOTSTRAP, {"tenant_id": "acme"})):
        for band in ("critical", "standard"):
            answer = await _post_key(gateway, credential, {**body, "priority": band})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "priority" and "batch" in error["message"]
        answer = await _post_key(gateway, credential, {**body, "priority": "batch"})
        assert answer.status_code == 201 and answer.json()["priority"] == "batch"


def test_the_cli_refuses_a_key_above_its_tenants_band(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tenants", "create", "acme", "--priority", "batch", "--db-url", db_url]) == 0
    capsys.readouterr()
    code = main(["keys", "create", "--tenant", "acme", "--priority", "critical", "--db-url", db_url])
    assert code == 1 and "priority" in capsys.readouterr().err


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_existing_keys_cannot_escape_a_lower_tenant_band(gateway: Gateway, tokenizer) -> None:
    """A row written before the check, and a tenant lowered after its keys were made: the worker
    gets the tenant's band, not the key's."""
    worker = RecordingWorker(tokenizer)
    server, address = await serve(worker)
    with gateway.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t", priority="critical")
        urgent = auth.create_key(s, "acme", actor="t", priority="critical")
        tenants.create_tenant(s, "beta", actor="t", priority="batch")
        # As an older gateway (or a direct database write) left it: above its tenant's band.
        legacy = auth.create_key(s, "beta", actor="t", priority="batch")
        s.get(ApiKey, legacy.info.id).priority = "critical"
    try:
        route_to(gateway, address, tokenizer)
        gateway.keys.refresh(full=True)

        async def band(key: str) -> str:
            worker.requests.clear()
            answer = await complete(gateway, key)
            assert answer.status_code == 200, answer.text
            return worker.requests[0].priority

        assert await band(urgent.secret) == "critical"
        assert await band(legacy.secret) == "batch"
        with gateway.sessions.begin() as s:
            tenants.set_flow_control(s, "acme", actor="t", priority="batch", max_concurrent_sequences=None)
        gateway.keys.refresh(full=True)
        assert await band(urgent.secret) == "batch"
        with gateway.sessions.begin() as s:  # unset: the default band (no deployment band here)
            tenants.set_flow_control(s, "acme", actor="t", priority=None, max_concurrent_sequences=None)
        gateway.keys.refresh(full=True)
        assert await band(urgent.secret) == "standard"
    finally:
        await server.stop(None)
