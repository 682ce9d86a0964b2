"""Issue 16: one resolution for deployments (`registry.resolve_for_deployment`), asked in-process
by `inferplane up` and over `GET /admin/v1/models/resolve` by the operator; URIs in the registry."""

from __future__ import annotations

import httpx
import pytest

from inferplane.api.model_resolution import ModelResolutionError, ResolvedModel
from inferplane.control_plane import auth, registry, tenants
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.storage.digest import sha256_file

BOOTSTRAP = "ipadmin_" + "r" * 40


def test_resolution_picks_the_version_or_the_latest_verified_and_names_what_is_missing(sessions, make_gguf,
                                                                                          tmp_path) -> None:
    one, two = make_gguf(tmp_path / "a.gguf", seed=1), make_gguf(tmp_path / "b.gguf", seed=2)
    with sessions.begin() as s:
        registry.register_model(s, str(one), actor="t", name="llm", version="1")
        registry.register_model(s, str(two), actor="t", name="llm", version="2")
        registry.register_model(s, str(two), actor="t", name="llm", version="3", expected_sha256="0" * 64)  # failed
    with sessions() as s:
        assert registry.resolve_for_deployment(s, "llm", "1").sha256 == sha256_file(one)
        latest = registry.resolve_for_deployment(s, "llm", None)
        assert (latest.version, latest.format, latest.uri) == ("2", "gguf", two.as_uri())
        with pytest.raises(ModelResolutionError) as missing:
            registry.resolve_for_deployment(s, "llm", "9")
        assert missing.value.reason == "ModelNotFound" and "llm@9" in missing.value.message
        with pytest.raises(ModelResolutionError) as failed:
            registry.resolve_for_deployment(s, "llm", "3")
        assert failed.value.reason == "ModelNotVerified" and "sha256 mismatch" in failed.value.message


def test_a_tenants_private_model_never_backs_a_deployment(sessions, two_tenants, make_gguf, tmp_path) -> None:
    with sessions.begin() as s:
        registry.register_model(s, str(make_gguf(tmp_path / "p.gguf")), actor="t", name="private-llm",
                                owner_tenant_id="acme")
    with sessions() as s, pytest.raises(ModelResolutionError) as missing:
        registry.resolve_for_deployment(s, "private-llm", None)
    assert missing.value.reason == "ModelNotFound"


def test_a_pvc_model_needs_its_digest_and_format_and_resolves_for_the_pods_to_verify(sessions) -> None:
    with sessions.begin() as s:
        with pytest.raises(InvalidInput, match="--sha256 and --format"):
            registry.register_model(s, "pvc://weights/llama/model.gguf", actor="t", name="pvc-llm")
        info = registry.register_model(s, "pvc://weights/llama/model.gguf", actor="t", name="pvc-llm",
                                       expected_sha256="a" * 64, model_format="gguf")
    assert info.status == "registered" and info.uri == "pvc://weights/llama/model.gguf"
    with sessions() as s:
        resolved = registry.resolve_for_deployment(s, "pvc-llm", None)
    assert (resolved.sha256, resolved.format) == ("a" * 64, "gguf")


@pytest.fixture
def gateway(tmp_path, make_gguf):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=BOOTSTRAP))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t1", actor="test")
        gw.tenant_admin = auth.create_key(session, "t1", actor="test", scopes=["infer", "admin"]).secret
        registry.register_model(session, str(make_gguf(tmp_path / "m.gguf")), actor="t", name="llm", version="1")
    gw.keys.refresh()
    yield gw
    gw.engine.dispose()


async def call(gw: Gateway, method: str, path: str, key: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.request(method, path, headers={"authorization": f"Bearer {key}"}, **kwargs)


async def test_the_resolve_endpoint_answers_the_platform_admin_only(gateway) -> None:
    found = await call(gateway, "GET", "/admin/v1/models/resolve", BOOTSTRAP, params={"name": "llm"})
    assert found.status_code == 200 and found.json()["version"] == "1" and len(found.json()["sha256"]) == 64
    missing = await call(gateway, "GET", "/admin/v1/models/resolve", BOOTSTRAP, params={"name": "llm", "version": "2"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "llm@2" in missing.json()["error"]["message"]
    tenant = await call(gateway, "GET", "/admin/v1/models/resolve", gateway.tenant_admin, params={"name": "llm"})
    assert tenant.status_code == 403


async def test_registering_a_uri_over_the_api_is_a_platform_admins_power(gateway) -> None:
    refused = await call(gateway, "POST", "/admin/v1/models", gateway.tenant_admin,
                         json={"source": "https://weights.example/model.gguf", "name": "remote"})
    assert refused.status_code == 403
    unreachable = await call(gateway, "POST", "/admin/v1/models", BOOTSTRAP,
                             json={"source": "http://127.0.0.1:9/model.gguf", "name": "remote"})
    assert unreachable.status_code == 400 and "cannot fetch" in unreachable.json()["error"]["message"]


def test_a_deployment_of_another_kind_than_its_model_is_refused_naming_both(sessions, make_gguf, tmp_path) -> None:
    """A chat deployment of an embedding model (or the reverse) would start workers that refuse the
    weights and restart forever: resolution carries the model's kind and the deployment's is checked."""
    from tests.control_plane.test_registry import _sentence_transformers_folder

    with sessions.begin() as s:
        registry.register_model(s, str(make_gguf(tmp_path / "chat.gguf")), actor="t", name="chat-llm")
        registry.register_model(s, str(_sentence_transformers_folder(tmp_path / "minilm")), actor="t", name="minilm")
    with sessions() as s:
        chat, encoder = (registry.resolve_for_deployment(s, name, None) for name in ("chat-llm", "minilm"))
    assert (chat.kind, encoder.kind) == ("generate", "embedding")
    chat.require_kind("generate")
    encoder.require_kind("embedding")
    with pytest.raises(ModelResolutionError) as wrong:
        encoder.require_kind("generate")
    assert wrong.value.reason == "ModelKindMismatch" and not wrong.value.retryable
    assert "minilm@1" in wrong.value.message and "spec.kind: embedding" in wrong.value.message
    # what the operator gets over the admin API carries the kind too
    assert ResolvedModel.from_dict(encoder.to_dict()).kind == "embedding"
