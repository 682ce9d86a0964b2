"""Issue 29, control-plane side: priority bands per tenant, per key and per deployment.

Set and validated through the admin API and the CLI (only api/priority.BANDS' names, a 422 or an
exit code naming `priority`), carried on the key cache's Principal, resolved tenant > deployment >
default, a key's band lowering it (never raising it: test_band_ceiling.py), and sent to the worker
on every GenerateRequest with the tenant id: a real gRPC worker records what arrives.
"""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.api.deployment import InferenceDeploymentSpec, SpecError
from inferplane.cli import main
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.auth import KeyCache
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.gateway.catalog import Catalog
from inferplane.control_plane.gateway.kube_sync import KubernetesCatalogSync
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.served_routes import resource_route, resource_routes
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import Endpoint, Router, StaticEndpointSource
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from tests.control_plane.fake_worker import RecordingWorker, complete, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

BOOTSTRAP = "bootstrap-admin-key-for-tests"




@pytest.fixture
def gateway(db_url: str):
    gw = Gateway(GatewaySettings(db_url=db_url, bootstrap_key=BOOTSTRAP))
    yield gw
    gw.engine.dispose()


async def _admin(gw: Gateway, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        answer = await client.request(method, path, json=body, headers={"authorization": f"Bearer {BOOTSTRAP}"})
    return answer.status_code, answer.json()


async def test_bands_and_limits_through_the_admin_api(gateway: Gateway) -> None:
    status, tenant = await _admin(gateway, "POST", "/admin/v1/tenants",
                                  {"id": "acme", "priority": "batch", "max_concurrent_sequences": 8})
    assert status == 201 and (tenant["priority"], tenant["max_concurrent_sequences"]) == ("batch", 8)
    status, error = await _admin(gateway, "POST", "/admin/v1/tenants", {"id": "bad", "priority": "urgent"})
    assert status == 422 and error["error"]["param"] == "priority"

    status, tenant = await _admin(gateway, "PATCH", "/admin/v1/tenants/acme", {"priority": "critical"})
    assert status == 200 and (tenant["priority"], tenant["max_concurrent_sequences"]) == ("critical", 8)
    status, error = await _admin(gateway, "PATCH", "/admin/v1/tenants/acme", {"priority": ""})
    assert status == 422 and error["error"]["param"] == "priority"
    status, listed = await _admin(gateway, "GET", "/admin/v1/tenants")
    assert [(t["id"], t["priority"], t["max_concurrent_sequences"]) for t in listed["data"]] == [
        ("acme", "critical", 8)]

    status, key = await _admin(gateway, "POST", "/admin/v1/keys",
                               {"tenant_id": "acme", "priority": "batch", "max_concurrent_sequences": 2})
    assert status == 201 and (key["priority"], key["max_concurrent_sequences"]) == ("batch", 2)
    status, error = await _admin(gateway, "POST", "/admin/v1/keys", {"tenant_id": "acme", "priority": "low"})
    assert status == 422 and error["error"]["param"] == "priority"
    # A key's limit above its tenant's could never be used: refused, naming the field.
    status, error = await _admin(gateway, "POST", "/admin/v1/keys", {"tenant_id": "acme",
                                                                    "max_concurrent_sequences": 9})
    assert status == 400 and error["error"]["param"] == "max_concurrent_sequences"
    status, keys = await _admin(gateway, "GET", "/admin/v1/keys?tenant_id=acme")
    assert [(k["priority"], k["max_concurrent_sequences"]) for k in keys["data"]] == [("batch", 2)]

    # The key cache follows: the next principal carries the tenant's new band; null removes it.
    principal = gateway.keys.verify(key["key"])
    assert (principal.priority, principal.tenant_priority) == ("batch", "critical")
    status, tenant = await _admin(gateway, "PATCH", "/admin/v1/tenants/acme", {"priority": None})
    assert status == 200 and tenant["priority"] is None and tenant["max_concurrent_sequences"] == 8
    assert gateway.keys.verify(key["key"]).tenant_priority is None


def test_the_principal_carries_bands_and_limits_from_memory(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t", priority="batch", max_concurrent_sequences=6)
        plain = auth.create_key(s, "acme", actor="t").secret
        urgent = auth.create_key(s, "acme", actor="t", priority="batch", max_concurrent_sequences=2).secret
        with pytest.raises(InvalidInput, match="priority"):
            auth.create_key(s, "acme", actor="t", priority="Critical")
        with pytest.raises(InvalidInput, match="priority"):
            tenants.create_tenant(s, "other", actor="t", priority="gold")
    cache = KeyCache(sessions)
    cache.refresh()
    first = cache.verify(plain)
    assert (first.priority, first.tenant_priority) == (None, "batch")
    assert (first.max_concurrent_sequences, first.tenant_max_concurrent_sequences) == (None, 6)
    second = cache.verify(urgent)
    assert (second.priority, second.max_concurrent_sequences) == ("batch", 2)
    with sessions.begin() as s:
        tenants.set_flow_control(s, "acme", actor="t", priority="standard", max_concurrent_sequences=None)
    cache.refresh()  # an incremental refresh: tenants are re-read whole every time
    assert (cache.verify(plain).tenant_priority, cache.verify(plain).tenant_max_concurrent_sequences) == (
        "standard", None)


def test_bands_and_limits_through_the_cli(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    db = ("--db-url", db_url)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, *db])
        out, err = capsys.readouterr()
        return code, out, err

    assert run("tenants", "create", "acme", "--priority", "batch", "--max-concurrent-sequences", "4")[0] == 0
    code, out, _ = run("tenants", "list", "--json")
    assert [(t["priority"], t["max_concurrent_sequences"]) for t in json.loads(out)] == [("batch", 4)]
    with pytest.raises(SystemExit) as bad:
        run("tenants", "create", "other", "--priority", "urgent")
    assert bad.value.code == 2 and "--priority" in capsys.readouterr().err
    code, _, err = run("tenants", "create", "other", "--max-concurrent-sequences", "0")
    assert code == 1 and "max_concurrent_sequences" in err

    code, out, _ = run("tenants", "update", "acme", "--priority", "critical", "--json")
    assert code == 0 and (json.loads(out)["priority"], json.loads(out)["max_concurrent_sequences"]) == ("critical", 4)
    code, out, _ = run("tenants", "update", "acme", "--max-concurrent-sequences", "none", "--json")
    assert code == 0 and (json.loads(out)["priority"], json.loads(out)["max_concurrent_sequences"]) == (
        "critical", None)
    code, out, _ = run("tenants", "update", "acme", "--priority", "none", "--json")
    assert code == 0 and json.loads(out)["priority"] is None

    code, out, _ = run("keys", "create", "--tenant", "acme", "--priority", "batch", "--max-concurrent-sequences",
                       "3", "--json")
    assert code == 0 and (json.loads(out)["priority"], json.loads(out)["max_concurrent_sequences"]) == ("batch", 3)
    code, out, _ = run("keys", "list", "--tenant", "acme", "--json")
    assert [(k["priority"], k["max_concurrent_sequences"]) for k in json.loads(out)] == [("batch", 3)]
    code, _, err = run("keys", "create", "--tenant", "acme", "--priority", "critical")  # above the tenant's
    assert code == 1 and "priority" in err
    with pytest.raises(SystemExit) as bad:
        run("keys", "create", "--tenant", "acme", "--priority", "gold")
    assert bad.value.code == 2


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_the_worker_gets_the_tenant_and_the_resolved_band(gateway: Gateway, tokenizer) -> None:
    """tenant > deployment > default, a key's band lowering it, on every prompt's request of a batched
    /v1/completions."""
    worker = RecordingWorker(tokenizer)
    server, address = await serve(worker)
    with gateway.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t")
        plain = auth.create_key(s, "acme", actor="t").secret
        batch_key = auth.create_key(s, "acme", actor="t", priority="batch").secret
    try:
        route_to(gateway, address, tokenizer)
        gateway.keys.refresh()

        async def sent(key: str, **body) -> list[tuple[str, str]]:
            worker.requests.clear()
            answer = await complete(gateway, key, **body)
            assert answer.status_code == 200, answer.text
            return [(r.tenant, r.priority) for r in worker.requests]

        assert await sent(plain) == [("acme", "standard")]  # nothing set anywhere: the default
        route_to(gateway, address, tokenizer, priority="batch")  # the deployment's band
        assert await sent(plain) == [("acme", "batch")]
        with gateway.sessions.begin() as s:
            tenants.set_flow_control(s, "acme", actor="t", priority="critical", max_concurrent_sequences=None)
        gateway.keys.refresh()
        assert await sent(plain) == [("acme", "critical")]  # the tenant's over the deployment's
        assert await sent(batch_key) == [("acme", "batch")]  # the key's over the tenant's
        assert await sent(plain, prompt=["one", "two", "three"]) == [("acme", "critical")] * 3
    finally:
        await server.stop(None)


def test_a_deployment_may_set_a_band_and_only_a_band() -> None:
    spec = {"model": {"name": "llama"}}
    assert InferenceDeploymentSpec.from_dict(spec).priority is None
    assert InferenceDeploymentSpec.from_dict({**spec, "priority": "batch"}).priority == "batch"
    with pytest.raises(SpecError) as bad:
        InferenceDeploymentSpec.from_dict({**spec, "priority": "urgent"})
    assert bad.value.field == "priority"


def _idep(name: str, **spec) -> dict:
    return {"metadata": {"name": name, "namespace": "team"},
            "spec": {"model": {"name": "llama"}, "serving": {"servedModelName": "m"}, **spec}}


async def test_the_cluster_sync_publishes_the_deployments_band(tokenizer) -> None:
    """The catalog entry carries it; deployments behind one name that disagree give the most urgent."""
    assert resource_route(_idep("a", priority="batch")).priority == "batch"
    worker = RecordingWorker(tokenizer)
    server, address = await serve(worker)
    catalog = Catalog()
    resources = [_idep("a", priority="batch")]
    sync = KubernetesCatalogSync(Router(), catalog, WorkerChannels(), lister=lambda: resources,
                                 source_factory=lambda service, ns: _Source([Endpoint(address)]))
    try:
        await sync.sync_once()
        assert catalog.get("m", None).priority == "batch"
        resources.append(_idep("b", priority="critical"))
        await sync.sync_once()
        assert catalog.get("m", None).priority == "critical"
        resources[:] = [_idep("a")]
        await sync.sync_once()
        assert catalog.get("m", None).priority is None
        assert [r.priority for r in resource_routes(resources)] == [None]
    finally:
        await sync.stop()
        await sync.channels.close()
        await server.stop(None)


class _Source(StaticEndpointSource):
    """An endpoint source whose poller does nothing (stands in for EndpointSlices)."""

    async def run(self, interval_s: float = 2.0) -> None:
        import asyncio

        await asyncio.Event().wait()
