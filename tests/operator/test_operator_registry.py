"""Issue 16, cluster path: the operator resolves `model: {name, version}` through the control
plane's registry (a real gateway app over the admin API, SQLite behind it) and the in-memory API.

The worker pod gets a fetch-model init container with the resolved URI and digest, the worker
loads from the digest-keyed cache, the status names the resolved version; an unknown model sets
ModelResolved False with the reason and creates no worker; a new version rolls the pod template.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferplane.bench.tiny_model import make_tiny_model
from inferplane.control_plane import registry
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.operator.model_pod import ANNOTATION_DIGEST
from inferplane.operator.registry_client import RegistryClient
from tests.operator.conftest import NAMESPACE, eventually
from tests.operator.test_operator_kmock import condition, create, patch, status_of

ADMIN = "ipadmin_test-registry-key"
BASE = f"/apis/inferplane.io/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'registry.db'}", bootstrap_key=ADMIN))
    first = make_tiny_model(tmp_path / "tiny-v1")
    second = make_tiny_model(tmp_path / "tiny-v2", seed=1)
    with gw.sessions.begin() as session:
        registry.register_model(session, str(first), actor="test", name="tiny", version="1")
        registry.register_model(session, str(second), actor="test", name="tiny", version="2")
    yield gw
    gw.engine.dispose()


@pytest.fixture
async def operator_with_registry(fake_api: tuple[Any, Path], gateway: Gateway) -> AsyncIterator[Any]:
    from inferplane.operator.config import OperatorConfig
    from tests.operator.fakeapi import running_operator

    api, kubeconfig = fake_api
    client = RegistryClient("http://control-plane", token=ADMIN, transport=httpx.ASGITransport(app=gateway.app))
    config = OperatorConfig(worker_image="registry.example/inferplane:test", post_events=False, registry=client,
                            max_backoff_seconds=1.0)
    async with running_operator(api, kubeconfig, config, namespaces=[NAMESPACE]):
        yield api


def resource(name: str, model: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": model, "runtime": "cpu-int8", "resources": {"cpu": "1", "memory": "2Gi"}}}


def pod_template(api: Any, name: str) -> dict[str, Any]:
    return (api.get("apps/v1/deployments", NAMESPACE, name) or {}).get("spec", {}).get("template", {})


def digest_of(gateway: Gateway, version: str) -> str:
    with gateway.sessions() as session:
        return registry.resolve_for_deployment(session, "tiny", version).sha256


async def test_a_registry_model_gets_a_verified_fetch_and_the_status_names_its_version(
        operator_with_registry: Any, gateway: Gateway) -> None:
    api = operator_with_registry
    code, created = await create(api, resource("chat", {"name": "tiny", "version": "1"}))
    assert code in (200, 201), created
    template = await eventually(lambda: pod_template(api, "chat"))
    digest = digest_of(gateway, "1")
    (init,) = template["spec"]["initContainers"]
    assert init["command"] == ["inferplane", "fetch-model"]
    assert init["args"][init["args"].index("--sha256") + 1] == digest
    assert init["args"][init["args"].index("--uri") + 1].startswith("file://")
    worker = template["spec"]["containers"][0]
    model_arg = worker["args"][worker["args"].index("--model") + 1]
    assert model_arg.startswith(f"/model-cache/{digest}/")
    assert template["metadata"]["annotations"][ANNOTATION_DIGEST] == digest
    assert {"name": "model-cache", "emptyDir": {}} in template["spec"]["volumes"]
    status = await eventually(lambda: status_of(api, "chat").get("model") and status_of(api, "chat"))
    assert status["model"]["version"] == "1" and status["model"]["sha256"] == digest
    assert condition(status, "ModelResolved")["status"] == "True"


async def test_an_unknown_model_is_a_false_condition_and_no_worker(operator_with_registry: Any) -> None:
    api = operator_with_registry
    await create(api, resource("ghost", {"name": "tiny", "version": "9"}))
    status = await eventually(lambda: condition(status_of(api, "ghost"), "ModelResolved"))
    assert status["status"] == "False" and status["reason"] == "ModelNotFound"
    assert "tiny@9" in status["message"]
    assert status_of(api, "ghost")["phase"] == "Degraded"
    assert api.get("apps/v1/deployments", NAMESPACE, "ghost") is None


async def test_a_model_of_another_kind_is_a_false_condition_and_no_worker(operator_with_registry: Any) -> None:
    """`tiny` generates: an embedding deployment of it would start workers that refuse the weights."""
    api = operator_with_registry
    body = resource("encoder", {"name": "tiny", "version": "1"})
    body["spec"].update(kind="embedding", runtime="embedding")
    await create(api, body)
    status = await eventually(lambda: condition(status_of(api, "encoder"), "ModelResolved"))
    assert status["status"] == "False" and status["reason"] == "ModelKindMismatch"
    assert "tiny@1" in status["message"] and "spec.kind: generate" in status["message"]
    assert api.get("apps/v1/deployments", NAMESPACE, "encoder") is None


async def test_a_new_version_rolls_the_pod_template_to_the_new_digest(
        operator_with_registry: Any, gateway: Gateway) -> None:
    api = operator_with_registry
    await create(api, resource("roll", {"name": "tiny", "version": "1"}))
    first = await eventually(lambda: pod_template(api, "roll").get("metadata", {}).get("annotations", {})
                             .get(ANNOTATION_DIGEST))
    assert first == digest_of(gateway, "1")
    assert await patch(api, f"{BASE}/roll", {"spec": {"model": {"name": "tiny", "version": "2"}}}) == 200
    second = await eventually(lambda: (pod_template(api, "roll")["metadata"]["annotations"][ANNOTATION_DIGEST]
                                       != first) and pod_template(api, "roll"))
    assert second["metadata"]["annotations"][ANNOTATION_DIGEST] == digest_of(gateway, "2")
    status = await eventually(lambda: status_of(api, "roll").get("model", {}).get("version") == "2"
                              and status_of(api, "roll"))
    assert status["model"]["sha256"] == digest_of(gateway, "2")


def _adapter_for(gateway: Gateway, tmp_path: Path, version: str, name: str) -> str:
    """A random adapter registered for tiny:`version`; returns its digest."""
    from inferplane.api.model_config import read_model_config
    from inferplane.bench.lora import write_random_adapter

    with gateway.sessions() as session:
        base = registry.get_model(session, registry.PLATFORM, f"tiny:{version}")
    folder = write_random_adapter(tmp_path / name, read_model_config(base.path), 4, ["q_proj"], seed=len(name))
    with gateway.sessions.begin() as session:
        return registry.register_adapter(session, folder, actor="test", base=f"tiny:{version}", name=name).sha256


async def test_preloaded_adapters_reach_every_worker_and_the_status(
        operator_with_registry: Any, gateway: Gateway, tmp_path: Path) -> None:
    from inferplane.operator.model_pod import ANNOTATION_ADAPTERS

    api = operator_with_registry
    sha = _adapter_for(gateway, tmp_path, "1", "bot")
    body = resource("tuned", {"name": "tiny", "version": "1"})
    body["spec"].update(adapters=[{"name": "bot"}], engine={"maxLoras": 2})
    await create(api, body)
    template = await eventually(lambda: pod_template(api, "tuned"))
    args = template["spec"]["containers"][0]["args"]
    flag = args[args.index("--preload-adapter") + 1]
    assert flag.startswith("bot=file://") and flag.endswith(f"#{sha}") and args[args.index("--max-loras") + 1] == "2"
    assert template["metadata"]["annotations"][ANNOTATION_ADAPTERS] == f"bot@1:{sha}"
    status = await eventually(lambda: status_of(api, "tuned").get("adapters") and status_of(api, "tuned"))
    assert status["adapters"] == [{"name": "bot", "version": "1", "sha256": sha}]


async def test_an_adapter_of_another_base_is_a_false_condition_and_no_worker(
        operator_with_registry: Any, gateway: Gateway, tmp_path: Path) -> None:
    api = operator_with_registry
    _adapter_for(gateway, tmp_path, "2", "v2-bot")
    body = resource("mismatch", {"name": "tiny", "version": "1"})
    body["spec"].update(adapters=[{"name": "v2-bot"}], engine={"maxLoras": 1})
    await create(api, body)
    status = await eventually(lambda: condition(status_of(api, "mismatch"), "ModelResolved"))
    assert status["status"] == "False" and status["reason"] == "AdapterBaseMismatch"
    assert "v2-bot@1" in status["message"] and "tiny@1" in status["message"]
    assert api.get("apps/v1/deployments", NAMESPACE, "mismatch") is None
    await create(api, {**resource("missing", {"name": "tiny", "version": "1"}),
                       "spec": {**body["spec"], "adapters": [{"name": "no-such-adapter"}]}})
    status = await eventually(lambda: condition(status_of(api, "missing"), "ModelResolved"))
    assert status["reason"] == "AdapterNotFound" and "no-such-adapter" in status["message"]
