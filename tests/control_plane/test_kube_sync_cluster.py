"""The cluster sync end to end: InferenceDeployments and EndpointSlices in an API server, a real
tiny worker process, the real gateway, completions over REST.

Only the Kubernetes API server is mocked: kmock, extended by ``tests.operator.fakeapi``, plus
(below) the two things that API lacks for this test: EndpointSlices as a resource and
``labelSelector`` filtering on lists. The gateway talks to it with the official ``kubernetes``
client through a kubeconfig, exactly as outside a cluster. No operator runs: the test plays the
operator (it writes the InferenceDeployment) and the EndpointSlice controller (it writes the slices
that point at the worker on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.test_utils
import attrs
import httpx
import kmock
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.kube_sync import KubernetesCatalogSync, load_api_client
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.local.supervisor import free_port
from tests.operator.fakeapi import FakeApiServer, write_kubeconfig

NS = "team-a"
OTHER_NS = "team-b"
IDEPS = "/apis/inferplane.io/v1alpha1/namespaces/{ns}/inferencedeployments"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"




# ---- the mocked API server ------------------------------------------------------------------------


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c==d,e!=f``): what the endpoint source sends."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


@attrs.define(kw_only=True)
class SlicesFakeApi(FakeApiServer):
    """FakeApiServer plus EndpointSlices and list label selectors (a real API server has both)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True, subresources=set(),
            verbs={"get", "list", "watch", "create", "patch", "delete"})

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            payload["items"] = [o for o in payload["items"]
                                if _matches((o.get("metadata") or {}).get("labels") or {}, selector)]
        return payload


@contextlib.asynccontextmanager
async def fake_cluster(namespaces: Iterable[str]) -> AsyncIterator[tuple[SlicesFakeApi, Path]]:
    """As ``fakeapi.fake_cluster``, with ``SlicesFakeApi``; yields (api, kubeconfig path)."""
    with tempfile.TemporaryDirectory(prefix="inferplane-kubesync-") as tmp:
        server_cls = functools.partial(aiohttp.test_utils.RawTestServer, handler_cancellation=True)

        def client_fct(url: Any) -> aiohttp.ClientSession:
            return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(force_close=True))

        async with SlicesFakeApi(namespaces=list(namespaces)) as api, \
                kmock.Server(api, server_cls=server_cls, client_fct=client_fct) as server:
            yield api, write_kubeconfig(str(server.url), Path(tmp))


async def api_call(api: SlicesFakeApi, method: str, path: str, body: Any = None) -> dict[str, Any]:
    async with api.clients[0].request(method, path, json=body) as response:
        payload = await response.json()
        assert response.status in (200, 201), (response.status, payload)
        return payload


def idep(name: str, namespace: str, served: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"name": "tiny-model"}, "serving": {"servedModelName": served}, **spec}}


def endpoint_slice(service: str, namespace: str, port: int, *, ready: bool = True) -> dict[str, Any]:
    """What the EndpointSlice controller writes for the operator's headless Service."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-abcde", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready},
                           "targetRef": {"kind": "Pod", "name": f"{service}-pod-0", "namespace": namespace}}],
            "ports": [{"name": "grpc", "port": port, "protocol": "TCP"},
                      {"name": "metrics", "port": 9, "protocol": "TCP"}]}


# ---- a real worker ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A tiny worker (tokenizer included) on 127.0.0.1, as tests/worker/test_worker_process.py starts
    one; its port. Not waited for: the sync must cope with a replica that is still loading."""
    yield from _tiny_worker(tmp_path_factory, "paged")


@pytest.fixture(scope="module")
def radix_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    yield from _tiny_worker(tmp_path_factory, "radix")


def _tiny_worker(tmp_path_factory: pytest.TempPathFactory, runtime: str) -> Iterator[int]:
    from inferplane.bench.tiny_model import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(folder / "model")
    port = free_port()
    log = open(folder / "worker.log", "wb")  # noqa: SIM115 (the child writes it until the end)
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferplane.cli", "worker", "--model", model, "--runtime", runtime, "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--max-model-len", "256",
         "--max-num-seqs", "8", "--drain-grace-seconds", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def eventually(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 90.0) -> Any:
    """Poll an async check until it returns something truthy (the sync works on intervals)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        try:
            last = await check()
        except (httpx.HTTPError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


async def complete(http: httpx.AsyncClient, key: str, model: str) -> httpx.Response:
    return await http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})


# ---- the sync inside a gateway ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def synced_gateway(kubeconfig: Path, tmp_path: Path, tenant_ids: list[str]
                         ) -> AsyncIterator[tuple[Gateway, int, dict[str, str]]]:
    """A gateway whose routes come from the cluster sync (watching NS), with a key per tenant."""
    port = free_port()
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=port, health_poll_interval=0.2))
    keys = {}
    with gateway.sessions.begin() as session:
        for tenant in tenant_ids:
            tenants.create_tenant(session, tenant, actor="test")
            keys[tenant] = auth.create_key(session, tenant, actor="test",
                                           scopes=(auth.SCOPE_INFER, auth.SCOPE_MODELS_READ)).secret
    api_client = load_api_client(str(kubeconfig))
    sync = KubernetesCatalogSync.from_api_client(api_client, gateway.router, gateway.catalog, gateway.channels,
                                                 namespaces=[NS], resync_interval=0.2, endpoint_interval=0.2)
    await gateway.start()
    sync.start()
    try:
        yield gateway, port, keys
    finally:
        await sync.stop()
        await gateway.stop()
        api_client.close()


@pytest.mark.timeout(180)
async def test_cluster_resources_become_routes_and_go_away(worker: int, tmp_path: Path) -> None:
    async with fake_cluster([NS, OTHER_NS]) as (api, kubeconfig):
        async with synced_gateway(kubeconfig, tmp_path, ["acme"]) as (gateway, port, keys):
            key = keys["acme"]
            # Outside the watched namespace: never routed, although its slice points at a live worker.
            await api_call(api, "POST", IDEPS.format(ns=OTHER_NS), idep("hidden", OTHER_NS, "hidden"))
            await api_call(api, "POST", SLICES.format(ns=OTHER_NS), endpoint_slice("hidden", OTHER_NS, worker))
            # Two arms of one served model; the slice of tiny-b lists a replica that is not ready.
            await api_call(api, "POST", IDEPS.format(ns=NS),
                           idep("tiny-a", NS, "tiny", serving={"servedModelName": "tiny", "weight": 70}))
            await api_call(api, "POST", IDEPS.format(ns=NS),
                           idep("tiny-b", NS, "tiny", serving={"servedModelName": "tiny", "weight": 30,
                                                               "tier": "spillover"}))
            await api_call(api, "POST", SLICES.format(ns=NS), endpoint_slice("tiny-a", NS, worker))
            await api_call(api, "POST", SLICES.format(ns=NS), endpoint_slice("tiny-b", NS, worker + 1, ready=False))

            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                async def served() -> bool:
                    reply = await complete(http, key, "tiny")
                    assert reply.status_code == 200, reply.text
                    return reply.json()

                body = await eventually(served, "a completion through the synced route")
                assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
                models = (await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).json()
                assert [m["id"] for m in models["data"]] == ["tiny"]
                deps = gateway.router.deployments("tiny")
                assert [(d.name, d.weight, d.tier.value) for d in deps] == [
                    ("team-a/tiny-a", 70.0, "primary"), ("team-a/tiny-b", 30.0, "spillover")]
                assert [e.address for e in deps[0].source.endpoints()] == [f"127.0.0.1:{worker}"]
                assert deps[1].source.endpoints() == ()  # not ready: not a candidate
                assert gateway.router.models() == ["tiny"]  # "hidden" lives in an unwatched namespace
                assert gateway.catalog.get("tiny", None).max_model_len == 256  # from the worker's Info

                # Delete one arm: the route shrinks. Delete the other: the model is gone (404).
                await api_call(api, "DELETE", IDEPS.format(ns=NS) + "/tiny-b")

                async def one_arm() -> bool:
                    return [d.name for d in gateway.router.deployments("tiny")] == ["team-a/tiny-a"]

                await eventually(one_arm, "tiny-b leaving the route")
                await api_call(api, "DELETE", IDEPS.format(ns=NS) + "/tiny-a")

                async def gone() -> bool:
                    return (await complete(http, key, "tiny")).status_code == 404

                await eventually(gone, "the served model to disappear")
                assert gateway.router.models() == [] and gateway.catalog.visible(None) == []


@pytest.mark.timeout(180)
async def test_mixed_cache_isolation_keeps_tenants_apart(radix_worker: int, tmp_path: Path) -> None:
    """One served name, a `shared` deployment (primary, taking the traffic) and a `tenant` one: the
    stricter wins, so two tenants never share the radix worker's prefix cache."""
    from tests.e2e.isolation import assert_tenants_do_not_share_the_prefix_cache

    async with fake_cluster([NS]) as (api, kubeconfig):
        async with synced_gateway(kubeconfig, tmp_path, ["acme", "globex"]) as (gateway, port, keys):
            await api_call(api, "POST", IDEPS.format(ns=NS), idep("open", NS, "mixed", cacheIsolation="shared"))
            await api_call(api, "POST", IDEPS.format(ns=NS),
                           idep("strict", NS, "mixed", cacheIsolation="tenant",
                                serving={"servedModelName": "mixed", "tier": "spillover"}))
            await api_call(api, "POST", SLICES.format(ns=NS), endpoint_slice("open", NS, radix_worker))
            await api_call(api, "POST", SLICES.format(ns=NS), endpoint_slice("strict", NS, radix_worker + 1,
                                                                             ready=False))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                async def served() -> bool:
                    reply = await complete(http, keys["acme"], "mixed")
                    assert reply.status_code == 200, reply.text
                    return True

                await eventually(served, "a completion through the synced route")
            assert gateway.catalog.get("mixed", None).cache_isolation == "tenant"
            await asyncio.to_thread(assert_tenants_do_not_share_the_prefix_cache, f"http://127.0.0.1:{port}",
                                    keys["acme"], keys["globex"], "mixed")


# ---- `inferplane gateway` as a process -------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_gateway_command_serves_cluster_models_and_stops_on_sigterm(worker: int, tmp_path: Path) -> None:
    async with fake_cluster([NS]) as (api, kubeconfig):
        port = free_port()
        (tmp_path / "bootstrap").write_text("ipadmin_test-bootstrap-secret\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "INFERPLANE_"))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferplane.cli", "gateway", "--kubeconfig", str(kubeconfig), "--namespace", NS,
             "--port", str(port), "--home", str(tmp_path / "home"), "--bootstrap-key-file", str(tmp_path / "bootstrap"),
             "--resync-interval", "0.2", "--endpoint-interval", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**env, "PYTHONUNBUFFERED": "1", "INFERPLANE_SALT_SECRET": "ab" * 16})
        try:
            await api_call(api, "POST", IDEPS.format(ns=NS), idep("tiny", NS, "tiny"))
            await api_call(api, "POST", SLICES.format(ns=NS), endpoint_slice("tiny", NS, worker))
            admin = {"Authorization": "Bearer ipadmin_test-bootstrap-secret"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                async def up() -> bool:
                    assert proc.poll() is None, "the gateway exited"
                    return (await http.get("/healthz")).status_code == 200

                await eventually(up, "the gateway to listen")
                created = await http.post("/admin/v1/tenants", headers=admin, json={"id": "acme"})
                assert created.status_code == 201, created.text
                made = await http.post("/admin/v1/keys", headers=admin, json={"tenant_id": "acme"})
                assert made.status_code == 201, made.text
                key = made.json()["key"]

                async def served() -> dict[str, Any]:
                    reply = await complete(http, key, "tiny")
                    assert reply.status_code == 200, reply.text
                    return reply.json()

                body = await eventually(served, "a completion through `inferplane gateway`")
                assert body["usage"]["completion_tokens"] == 4
            assert (tmp_path / "home" / "inferplane.db").exists()  # the SQLite fallback under --home
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
            assert proc.returncode == 0, out
            assert "Traceback" not in out, out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
