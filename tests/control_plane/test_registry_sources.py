"""Issue 53, items 8 and 9: a model or adapter source the registry cannot take is a 4xx naming it.

A NUL byte in a source path raised ValueError inside the OS calls (a 500); a symlink inside a model
folder under `--model-root` led out of it (the folder itself was confined, its files were not).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.errors import Forbidden, InvalidInput
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.registry import confine_source, register_model, resolve_source

BOOTSTRAP = "ipadmin_" + "c" * 40


@pytest.fixture
def gateway(tmp_path: Path):
    root = tmp_path / "models"
    root.mkdir()
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=BOOTSTRAP,
                                 model_roots=(str(root),)))
    gw.root = root
    yield gw
    gw.engine.dispose()


async def post(gw: Gateway, path: str, **body) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post(path, json=body, headers={"authorization": f"Bearer {BOOTSTRAP}"})


# -- NUL bytes ---------------------------------------------------------------------------------------


def _nul_sources(root: Path) -> list[str]:
    return [f"{root}/a\x00b.gguf", f"file://{root}/a%00b.gguf", f"{root}/\x00", f"file://{root}/x\x00/y"]


async def test_a_nul_byte_in_a_model_source_is_a_400_naming_source(gateway, make_gguf) -> None:
    make_gguf(gateway.root / "a")  # "a\x00b" would be "a" to a C call: it must not find this file
    for source in _nul_sources(gateway.root):
        answer = await post(gateway, "/admin/v1/models", source=source)
        assert answer.status_code == 400, (source, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "source" and "NUL" in error["message"], error


async def test_a_nul_byte_in_an_adapter_source_is_a_400_naming_source(gateway, make_gguf) -> None:
    base = await post(gateway, "/admin/v1/models", source=str(make_gguf(gateway.root / "base.gguf")))
    assert base.status_code == 201, base.text
    for source in _nul_sources(gateway.root):
        answer = await post(gateway, "/admin/v1/adapters", source=source, base="base")
        assert answer.status_code == 400, (source, answer.text)
        assert answer.json()["error"]["param"] == "source"


@pytest.mark.parametrize("source", ["/tmp/a\x00b.gguf", "file:///tmp/a%00b.gguf", "relative\x00.gguf"])
def test_the_cli_paths_refuse_a_nul_byte_too(sessions: sessionmaker[Session], source: str) -> None:
    """`inferplane models register` and `inferplane up` reach resolve_source without confine_source."""
    with pytest.raises(InvalidInput, match="NUL") as refused:
        resolve_source(source)
    assert refused.value.param == "source"
    with sessions.begin() as session, pytest.raises(InvalidInput, match="NUL"):
        register_model(session, source, actor="test")


def test_a_nul_byte_in_a_remote_source_is_a_400(sessions: sessionmaker[Session], tmp_path: Path) -> None:
    for source in ("https://example.com/a\x00b.gguf", "s3://bucket/k\x00.gguf", "pvc://claim/a\x00.gguf"):
        with sessions.begin() as session, pytest.raises(InvalidInput):
            register_model(session, source, actor="test", cache_root=tmp_path, expected_sha256="0" * 64,
                           model_format="gguf")


# -- symlinks inside a confined folder ---------------------------------------------------------------


def _hf_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 2048}')
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.bin").write_bytes(b"secret")
    (folder / "sub").mkdir()
    (folder / "sub" / "x.bin").write_bytes(b"x")
    return folder


ESCAPES = {
    "a file": lambda folder, out: os.symlink(out / "secret.bin", folder / "tokenizer.json"),
    "a weight file": lambda folder, out: (os.remove(folder / "model.safetensors"),
                                          os.symlink(out / "secret.bin", folder / "model.safetensors")),
    "a folder": lambda folder, out: os.symlink(out / "sub", folder / "extra"),
    "a hidden file": lambda folder, out: (os.mkdir(folder / ".cache"),
                                          os.symlink(out / "secret.bin", folder / ".cache" / "x")),
    "a file in a subfolder": lambda folder, out: (os.mkdir(folder / "nested"),
                                                  os.symlink(out / "secret.bin", folder / "nested" / "w.bin")),
    "a relative link": lambda folder, out: os.symlink(os.path.relpath(out / "secret.bin", folder),
                                                      folder / "rel.bin"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_a_symlink_inside_a_model_folder_may_not_lead_out_of_the_roots(tmp_path: Path, outside: Path,
                                                                      case: str) -> None:
    root = tmp_path / "models"
    folder = _hf_folder(root / "m")
    ESCAPES[case](folder, outside)
    with pytest.raises(Forbidden, match="symlink that leads outside the model roots"):
        confine_source(str(folder), [root], platform_admin=True)


def test_a_link_through_a_folder_inside_the_roots_is_followed(tmp_path: Path, outside: Path) -> None:
    """A symlinked folder that stays in the roots is looked into: a link in it may not lead out."""
    root = tmp_path / "models"
    folder = _hf_folder(root / "m")
    (root / "shared").mkdir()
    os.symlink(outside / "secret.bin", root / "shared" / "w.bin")
    os.symlink(root / "shared", folder / "shared")
    with pytest.raises(Forbidden, match="shared"):
        confine_source(str(folder), [root], platform_admin=True)


def test_links_that_stay_in_the_roots_are_fine(tmp_path: Path) -> None:
    """A Hugging Face cache under the root: snapshot files link to blobs in the same root. Loops end."""
    root = tmp_path / "models"
    folder = _hf_folder(root / "snapshots" / "abc")
    (root / "blobs").mkdir()
    (root / "blobs" / "1234").write_bytes(b"\0" * 16)
    os.remove(folder / "model.safetensors")
    os.symlink(root / "blobs" / "1234", folder / "model.safetensors")
    os.symlink(folder, folder / "loop")  # a link to itself: walked once
    assert confine_source(str(folder), [root], platform_admin=True) == str(folder)


async def test_the_admin_api_refuses_a_folder_with_a_link_out(gateway, outside: Path) -> None:
    folder = _hf_folder(gateway.root / "m")
    os.symlink(outside / "secret.bin", folder / "model-00002.safetensors")
    answer = await post(gateway, "/admin/v1/models", source=str(folder))
    assert answer.status_code == 403, answer.text
    assert "model-00002.safetensors" in answer.json()["error"]["message"]
    os.remove(folder / "model-00002.safetensors")
    assert (await post(gateway, "/admin/v1/models", source=str(folder))).status_code == 201


async def test_the_admin_api_refuses_an_adapter_folder_with_a_link_out(gateway, outside: Path, make_gguf) -> None:
    base = await post(gateway, "/admin/v1/models", source=str(make_gguf(gateway.root / "base.gguf")))
    assert base.status_code == 201
    adapter = gateway.root / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    os.symlink(outside / "secret.bin", adapter / "adapter_model.safetensors")
    answer = await post(gateway, "/admin/v1/adapters", source=str(adapter), base="base")
    assert answer.status_code == 403, answer.text
