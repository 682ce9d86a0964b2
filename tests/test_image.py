"""The container image: one description (deploy/image/image.py) for the Dockerfile and the offline
builder (deploy/image/build.py). The committed Dockerfile must be the generated one, and the cache
keys must change with what goes in and only with that. No root, network or container engine needed."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from deploy.image import build, image

ROOT = Path(__file__).resolve().parents[1]


def test_committed_dockerfile_is_the_generated_one() -> None:
    assert image.DOCKERFILE.read_text() == image.dockerfile(), \
        "Dockerfile is stale: run `python deploy/image/image.py --write` and commit the result"


def _run_lines(dockerfile: str) -> list[str]:
    joined = re.sub(r" \\\n\s*", " ", dockerfile)
    return [line.removeprefix("RUN ") for line in joined.splitlines() if line.startswith("RUN ")]


def test_the_dockerfile_runs_the_offline_builders_steps() -> None:
    """Each layer is the same shell commands in both builds (the Docker one installs from a source copy)."""
    described = image.describe()
    runs = _run_lines(image.dockerfile(described))
    assert len(runs) == 1 + len(described.layers)
    for layer, run in zip(described.layers, runs[1:], strict=True):
        steps = layer.steps(image.SOURCE_DIR)
        assert run.split(" && ")[:len(steps)] == steps
    assert f"apt-get install -y --no-install-recommends {' '.join(described.base.packages)}" in runs[0]
    assert all(command in runs[0] for command in (*described.base.setup, *described.base.strip))


def test_torch_pin_and_runtime_dependencies_follow_the_project() -> None:
    described = image.describe()
    torch_layer, app_layer = described.layers
    assert torch_layer.requires == ("torch==2.13.0",)
    assert image.TORCH in (ROOT / "scripts" / "install.sh").read_text(), "the image and `make install` pin one torch"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if not d.startswith("torch")] == list(app_layer.requires)
    assert described.project.startswith("inferplane==")


def test_digest_frames_its_parts_and_ignores_their_order() -> None:
    assert build.digest({"a": "1", "b": "2"}) == build.digest({"b": "2", "a": "1"})
    assert build.digest({"a": "bc"}) != build.digest({"ab": "c"})
    assert build.digest({"a": "1", "b": ""}) != build.digest({"a": "1"})
    assert build.digest({"a": b"x"}) == build.digest({"a": "x"})
    assert re.fullmatch(r"[0-9a-f]{64}", build.digest({}))


def _copy_project(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for name in ("pyproject.toml", "README.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    for name in ("inferplane/__init__.py", "deploy/image/pause.c"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    (root / "proto").mkdir()
    return root


def test_a_source_change_changes_the_image_key_but_not_the_base_and_torch_layers(tmp_path: Path) -> None:
    root = _copy_project(tmp_path)
    described = image.describe(root)
    args = dict(described.build_args)
    before = build.image_key(described, build.input_files(root), args)
    torch_layer = described.layers[0]
    wheels = ["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"]
    torch_before = build.layer_key(build.base_key(described), torch_layer, args, wheels)

    (root / "inferplane" / "__init__.py").write_text("# changed\n")
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"redis>=5"', '"redis>=6"'))
    changed = image.describe(root)
    assert changed.layers[1] != described.layers[1]
    assert build.image_key(changed, build.input_files(root), args) != before
    assert build.base_key(changed) == build.base_key(described)
    assert build.layer_key(build.base_key(changed), changed.layers[0], args, wheels) == torch_before

    # ... while what the torch layer installs from does change it.
    assert build.layer_key(build.base_key(changed), changed.layers[0], args, [*wheels, "x.whl"]) != torch_before
    cpu = {**args, "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    assert build.layer_key(build.base_key(changed), changed.layers[0], cpu, wheels) != torch_before
    assert build.image_key(changed, build.input_files(root), cpu) != build.image_key(
        changed, build.input_files(root), args)


def test_input_files_skip_build_leftovers_and_include_the_builder(tmp_path: Path) -> None:
    root = _copy_project(tmp_path)
    (root / "inferplane" / "__pycache__").mkdir()
    (root / "inferplane" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    files = build.input_files(root)
    assert "inferplane/__init__.py" in files and "deploy/image/pause.c" in files
    assert not any("__pycache__" in name for name in files)
    assert {"deploy/image/image.py", "deploy/image/build.py", "deploy/image/pause.c"} <= set(build.input_files())


def test_without_root_an_uncached_build_says_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.os, "geteuid", lambda: 1000)
    with pytest.raises(build.BuildError, match="needs root"):
        build.build_images(tmp_path)
    with pytest.raises(build.BuildError, match="unknown build argument"):
        build.build_images(tmp_path, build_args={"NOPE": "1"})


def test_a_cached_result_is_returned_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.os, "geteuid", lambda: 1000)  # would refuse to build
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    described = image.describe()
    key = build.image_key(described, build.input_files(), described.build_args)
    folder = tmp_path / "images" / key
    folder.mkdir(parents=True)
    result = {"key": key}
    for part, file in (("image", "inferplane.oci.tar"), ("pause", "pause.oci.tar")):
        (folder / file).write_bytes(b"")
        result[part] = {"archive": str(folder / file), "ref": f"x:{part}", "archive_bytes": 0, "installed_bytes": 0}
    (folder / "image.json").write_text(json.dumps(result))
    assert build.build_images() == result


def test_pause_exits_0_on_sigterm_and_reaps_children(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    binary = tmp_path / "pause"
    compiled = subprocess.run([gcc, *build.PAUSE_FLAGS, "-o", str(binary), str(build.HERE / "pause.c")],
                              capture_output=True, text=True)
    if compiled.returncode != 0 and "-lc" in compiled.stderr:
        pytest.skip("no static libc (libc6-dev)")
    assert compiled.returncode == 0, compiled.stderr
    # pause as the parent of a short-lived child (exec keeps the PID): the child must not stay a zombie.
    proc = subprocess.Popen(["/bin/sh", "-c", f"sleep 0.2 & exec {binary}"])
    time.sleep(1.0)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert children == [], f"unreaped children {children}"
    assert proc.poll() is None, "pause returned on its own"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0


@pytest.mark.parametrize("index", ["", "https://download.pytorch.org/whl/cpu"])
def test_the_pip_steps_hand_pip_the_requirements_as_written(index: str) -> None:
    """The steps' shell quoting (markers with quotes, `>=`, `!` epochs) and the optional index argument."""
    described = image.describe()
    for layer in described.layers:
        install = next(s for s in layer.steps("/src") if s.startswith(f"{image.PIP} install ")
                       and "--no-deps" not in s)
        shown = install.replace(f"{image.PIP} install", "printf '%s\\n'", 1)
        env = {"PATH": "/usr/bin:/bin", **({layer.index_arg: index} if layer.index_arg else {})}
        words = subprocess.run(["/bin/sh", "-c", shown], env=env, capture_output=True, text=True,
                               check=True).stdout.splitlines()
        expected_index = ["--index-url", index] if layer.index_arg and index else []
        assert words == [*expected_index, *layer.requires]
