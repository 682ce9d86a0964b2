"""Issue 53, item 9: a tenant admin sees no server file path through the admin API.

Registry entries' `uri` and `status_detail`, and registration errors, named the gateway's files
(a tenant admin's own alias registration answered with the site-packages path of its weights). A
tenant admin now sees the alias it registered from, or the URI's scheme with the rest redacted, and
paths in details and errors redacted; a platform admin keeps all of them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from inferplane.api.model_config import read_model_config
from inferplane.api.model_resolution import builtin_model_path
from inferplane.bench.lora import write_random_adapter
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.control_plane import auth, registry, tenants
from inferplane.control_plane.gateway.admin_views import REDACTED, redact_paths, shown_uri
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

BOOTSTRAP = "ipadmin_" + "r" * 40


@pytest.fixture
def gateway(tmp_path: Path):
    root = tmp_path / "models"
    make_tiny_model(root / "tiny")
    write_random_adapter(root / "helper", read_model_config(root / "tiny"), 4, ["q_proj", "v_proj"], seed=1)
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=BOOTSTRAP,
                                 model_roots=(str(root),)))
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t")
        gw.tenant_admin = auth.create_key(s, "acme", actor="t", scopes=["infer", "admin"]).secret
    gw.keys.refresh()
    gw.root = root
    yield gw
    gw.engine.dispose()


async def _call(gw: Gateway, method: str, path: str, key: str, body: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.request(method, path, json=body, headers={"authorization": f"Bearer {key}"})


def _server_paths(text: str, *roots: Path) -> list[str]:
    return [s for s in (*map(str, roots), "site-packages", "file:///", "/tmp/", "/work/", "/usr/") if s in text]


async def test_a_tenant_admin_sees_aliases_and_redacted_uris(gateway) -> None:
    root, admin, tenant = gateway.root, BOOTSTRAP, gateway.tenant_admin
    assert (await _call(gateway, "POST", "/admin/v1/models", admin, {"source": str(root / "tiny"),
                                                                       "name": "tiny"})).status_code == 201
    adapter = await _call(gateway, "POST", "/admin/v1/adapters", admin, {"source": str(root / "helper"),
                                                                          "base": "tiny"})
    assert adapter.status_code == 201, adapter.text
    own = await _call(gateway, "POST", "/admin/v1/models", tenant, {"source": "smollm2-135m", "name": "mine"})
    assert own.status_code == 201 and own.json()["uri"] == "smollm2-135m"  # what it supplied
    assert _server_paths(own.text, root) == [], own.text

    models = await _call(gateway, "GET", "/admin/v1/models", tenant)
    assert {m["name"]: m["uri"] for m in models.json()["data"]} == {
        "tiny": f"file://{REDACTED}", "helper": f"file://{REDACTED}", "mine": "smollm2-135m"}
    adapters = await _call(gateway, "GET", "/admin/v1/adapters", tenant)
    assert [a["uri"] for a in adapters.json()["data"]] == [f"file://{REDACTED}"]
    for answer in (models, adapters):
        assert _server_paths(answer.text, root) == [], answer.text

    # The platform admin keeps every path.
    listed = (await _call(gateway, "GET", "/admin/v1/models", admin)).json()["data"]
    assert {m["name"]: m["uri"] for m in listed} == {
        "tiny": (root / "tiny").resolve().as_uri(), "helper": (root / "helper").resolve().as_uri(),
        "mine": builtin_model_path("smollm2-135m").resolve().as_uri()}
    assert (await _call(gateway, "GET", "/admin/v1/adapters", admin)).json()["data"][0]["uri"] == (
        (root / "helper").resolve().as_uri())


async def test_a_failed_check_names_no_path_to_a_tenant_admin(gateway) -> None:
    root = gateway.root
    assert (await _call(gateway, "POST", "/admin/v1/models", BOOTSTRAP, {"source": str(root / "tiny"),
                                                                           "name": "tiny"})).status_code == 201
    shutil.rmtree(root / "tiny")
    with gateway.sessions.begin() as s:
        assert registry.verify_model(s, auth.ALL_TENANTS, "tiny", actor="t").status == "failed"
    (tenant_view,) = (await _call(gateway, "GET", "/admin/v1/models", gateway.tenant_admin)).json()["data"]
    (admin_view,) = (await _call(gateway, "GET", "/admin/v1/models", BOOTSTRAP)).json()["data"]
    assert str(root / "tiny") in admin_view["status_detail"]
    assert tenant_view["status"] == "failed" and REDACTED in tenant_view["status_detail"]
    assert _server_paths(tenant_view["status_detail"], root) == []


async def test_a_tenant_admins_errors_name_no_path(gateway) -> None:
    mine = await _call(gateway, "POST", "/admin/v1/models", gateway.tenant_admin, {"source": "smollm2-135m",
                                                                                    "name": "mine"})
    assert mine.status_code == 201
    # An alias is weights, not a PEFT folder: the error used to name the file it read.
    refused = await _call(gateway, "POST", "/admin/v1/adapters", gateway.tenant_admin,
                          {"source": "smollm2-135m", "base": "mine"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "source"
    assert _server_paths(refused.text) == [] and REDACTED in refused.json()["error"]["message"]
    assert (await _call(gateway, "POST", "/admin/v1/models", BOOTSTRAP, {"source": "smollm2-135m",
                                                                           "name": "plat"})).status_code == 201
    same = await _call(gateway, "POST", "/admin/v1/adapters", BOOTSTRAP, {"source": "smollm2-135m", "base": "plat"})
    assert same.status_code == 400 and "site-packages" in same.text  # the platform admin's keeps the path


@pytest.mark.parametrize(("text", "shown"), [
    ("weights are gone: /var/lib/models/x.gguf", f"weights are gone: {REDACTED}"),
    ("cannot fetch s3://bucket/key/model.gguf: denied", f"cannot fetch {REDACTED}: denied"),
    ("'/srv/m' is outside", f"'{REDACTED}' is outside"),
    ("sha256 changed: recorded ab, now cd", "sha256 changed: recorded ab, now cd"),
    ("invalid model name 'org/model': letters, digits, '.', '_', '-', '/'", None),
    ("/admin/v1/models/resolve is an endpoint", None),
])
def test_redact_paths(text: str, shown: str | None) -> None:
    assert redact_paths(text) == (text if shown is None else shown)


def test_shown_uri() -> None:
    assert shown_uri(builtin_model_path("smollm2-135m").resolve().as_uri()) == "smollm2-135m"
    assert shown_uri("s3://bucket/models/x") == f"s3://{REDACTED}"
    assert shown_uri("pvc://claim/path") == f"pvc://{REDACTED}"
    assert shown_uri("/bare/path") == REDACTED
