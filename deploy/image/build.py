"""Builds the inferplane image and a pause image offline: no container engine, no registry.

What the machine needs: root, debootstrap, buildah and gcc (Debian packages), and PyPI plus a Debian
mirror over the network. The image is the one deploy/image/image.py describes (the Dockerfile is
generated from the same description):

1. the base layer: `debootstrap --variant=minbase --include=<packages>` straight into a buildah
   working container, then the description's setup and strip commands in a chroot;
2. wheels, fetched on the host for the base layer's python3 (its version and PEP 508 markers are
   read there): pip inside the image's root cannot reach PyPI where TLS is intercepted, so nothing
   is downloaded there; the project's own wheel is built from a copy of exactly the files the key
   hashes;
3. the torch layer, then the app layer: the description's shell steps in a chroot of a working
   container made from the layer below, pip pointed at the wheels (bind-mounted read-only, so none
   stays in the image) by PIP_NO_INDEX and PIP_FIND_LINKS; the app layer also gets the image's
   configuration (env, user, entrypoint...) and is checked as uid 10001 before it is committed;
4. `buildah push` into an OCI archive; then the pause image (pause.c, built with `gcc -static`).

No `buildah run` or `bud`: runc cannot lower oom_score_adj or raise rlimits without
CAP_SYS_RESOURCE, which such machines lack, so RUN steps fail there; chroot needs neither.

Everything is cached under ${INFERPLANE_IMAGE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/inferplane/images}:

    wheels/<key>/               wheels per layer, keyed by its requirements, index and Python
    buildah/                    buildah's own storage (vfs): the base and torch layers' images,
                                tagged with their own keys, so a change to the project rebuilds the
                                app layer only
    images/<key>/inferplane.oci.tar, pause.oci.tar, image.json
                                the result; <key> hashes everything that goes in (the description,
                                the project's sources under inferplane/ and proto/, pyproject.toml,
                                README.md and this folder); the last three results are kept

Run as root with the project's venv (its pip fetches the wheels):
`.venv/bin/python deploy/image/build.py [--out CACHE_DIR]`; steps are reported on stderr, one line
each with its time, and the result is one JSON line on stdout (also `build_images()`'s return):
archive paths, image refs, archive and installed sizes. When the result is cached it returns in
about a second, without root.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

try:
    from deploy.image import image as description
except ModuleNotFoundError:  # run as a script, or loaded from its path: the sibling file, by its path
    _spec = importlib.util.spec_from_file_location("inferplane_image_description", Path(__file__).with_name("image.py"))
    assert _spec is not None and _spec.loader is not None
    description = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = description  # before running it: dataclasses look their module up
    _spec.loader.exec_module(description)

HERE = Path(__file__).resolve().parent
ROOT = description.ROOT
CACHE_ENV = "INFERPLANE_IMAGE_CACHE"
# Bump when the way a layer is built changes without its description changing: the cached base and
# torch layers are then rebuilt (a change to this file alone rebuilds only the final image).
LAYER_FORMAT = "1"
# Layer images kept between builds, in the builder's own storage.
LAYER_REPO = "localhost/inferplane-build"
PAUSE_NAME = "localhost/inferplane/pause"
PAUSE_FLAGS = ("-static", "-Os", "-s", "-Wall", "-Wextra")
KEEP_RESULTS = 3
# Wheels for the image's python3 (bookworm: CPython 3.11, glibc 2.36) whatever the host runs.
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
             "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
# The image's interpreter as PEP 508 markers see it, read in the base layer. pip download evaluates
# markers against the interpreter running pip, whatever --python-version says: on a host's 3.11.7,
# redis's `async-timeout; python_full_version < "3.11.3"` is dropped, and bookworm's 3.11.2 needs it.
MARKER_ENVIRONMENT = r"""
import json, os, platform, sys
v = sys.implementation.version
print(json.dumps({
    "implementation_name": sys.implementation.name,
    "implementation_version": f"{v.major}.{v.minor}.{v.micro}"
                              + ("" if v.releaselevel == "final" else f"{v.releaselevel[0]}{v.serial}"),
    "os_name": os.name, "platform_machine": platform.machine(), "platform_system": platform.system(),
    "platform_release": platform.release(), "platform_version": platform.version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_full_version": platform.python_version(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}))
"""
# The host's pip, with markers evaluated for the image's interpreter (argv[1]: its environment).
PIP_FOR_IMAGE = """
import json, sys
from pip._vendor.packaging import markers
target = json.loads(sys.argv.pop(1))
markers.default_environment = lambda: dict(target)
from pip._internal.cli.main import main
sys.exit(main())
"""
# Kernel fields: the build host's, in no marker we install; kept out of the wheels' key.
HOST_FIELDS = ("platform_release", "platform_version")
CHECK_HOME = "/tmp/inferplane-check"
# Run in the image's root as uid 10001 before the app layer is committed: what the worker, the
# gateway and the operator import, a CPU matmul (torch without triton), the demo model, and the
# native kernels compiled with the image's gcc.
CHECK = r"""
import importlib.util, json
import torch
import inferplane.control_plane, inferplane.operator, inferplane.worker
from inferplane.api.model_resolution import builtin_model_path
from inferplane.worker.ops import native
assert float(torch.ones(2) @ torch.ones(2)) == 2.0
model = builtin_model_path("smollm2-135m")
kernels = native.kernels() if native.supported_isas() else None
assert kernels is not None or not native.supported_isas(), "the native kernels did not build"
print(json.dumps({"torch": torch.__version__, "triton": importlib.util.find_spec("triton") is not None,
                  "model": str(model), "model_bytes": model.stat().st_size,
                  "native_isa": kernels.isa if kernels else None}))
"""


class BuildError(RuntimeError):
    """A step failed; the message says which and ends with the tail of the build log."""


def default_cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "inferplane" / "images"


def digest(parts: Mapping[str, str | bytes]) -> str:
    """sha256 over named parts: independent of their order, and no two different inputs run together
    (each name and value is framed by its length)."""
    h = hashlib.sha256()
    for name in sorted(parts):
        value = parts[name]
        data = value.encode() if isinstance(value, str) else value
        h.update(f"{len(name)}:{name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def _ignored(relative: Path) -> bool:
    return (any(part == "__pycache__" or part.endswith(".egg-info") for part in relative.parts)
            or relative.suffix in (".pyc", ".pyo", ".so"))


def input_files(root: Path = ROOT) -> dict[str, bytes]:
    """The files that go into the image, or decide how it is built, by path relative to `root`."""
    files: dict[str, bytes] = {}
    for top in ("inferplane", "proto", "deploy/image"):
        for path in sorted((root / top).rglob("*")):
            relative = path.relative_to(root)
            if path.is_file() and not _ignored(relative):
                files[str(relative)] = path.read_bytes()
    for name in ("pyproject.toml", "README.md"):
        files[name] = (root / name).read_bytes()
    return files


def image_key(image: description.Image, files: Mapping[str, bytes], build_args: Mapping[str, str]) -> str:
    """The result's key: the description, the build arguments and every input file."""
    return digest({"format": LAYER_FORMAT, "description": image.as_json(),
                   "build_args": json.dumps(dict(sorted(build_args.items()))),
                   **{f"file:{name}": data for name, data in files.items()}})


def base_key(image: description.Image) -> str:
    """The base layer's key: its packages and commands only."""
    return digest({"format": LAYER_FORMAT, "base": json.dumps(asdict(image.base), sort_keys=True),
                   "build_env": json.dumps(image.build_env, sort_keys=True)})


def layer_key(parent: str, layer: description.Layer, build_args: Mapping[str, str], wheels: list[str]) -> str:
    """A pip layer's key: the layer below, its steps and build argument, and the wheels it installs from."""
    arg = build_args.get(layer.index_arg, "") if layer.index_arg else ""
    return digest({"format": LAYER_FORMAT, "parent": parent, "layer": json.dumps(asdict(layer)),
                   "steps": "\n".join(layer.steps("{project}")), "index": arg, "wheels": "\n".join(sorted(wheels))})


def wheels_key(layer: description.Layer, index_url: str, python: Mapping[str, str]) -> str:
    """Where a layer's wheels are cached: its requirements, index and target interpreter."""
    interpreter = {k: v for k, v in python.items() if k not in HOST_FIELDS}
    return digest({"requires": "\n".join(layer.requires), "no_deps": "\n".join(layer.requires_no_deps),
                   "index": index_url, "python": json.dumps(interpreter, sort_keys=True),
                   "platforms": " ".join(PLATFORMS)})


def _short(key: str) -> str:
    return key[:12]


class Builder:
    """One build, under the cache's lock: steps run in order, each timed and logged."""

    def __init__(self, cache: Path, image: description.Image, build_args: Mapping[str, str],
                 files: Mapping[str, bytes], key: str, out: TextIO) -> None:
        self.cache, self.image, self.build_args, self.files, self.key, self.out = \
            cache, image, build_args, files, key, out
        self.store = cache / "buildah"
        self.log_path = cache / "build.log"
        self.result_dir = cache / "images" / key

    # --- running things ---

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.out.write(f"image: {what} ...")
        self.out.flush()
        start = time.monotonic()
        try:
            yield
        except BaseException:
            self.out.write(" FAILED\n")
            raise
        took = time.monotonic() - start
        self.out.write(f" {took:.1f} s\n")
        self.out.flush()

    def sh(self, argv: list[str], *, env: Mapping[str, str] | None = None, capture: bool = False) -> str:
        """Runs a command with its output in the build log (stdout returned instead when `capture`)."""
        with open(self.log_path, "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            done = subprocess.run(argv, stdout=subprocess.PIPE if capture else log, stderr=log, text=True,
                                  env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-40:])
            raise BuildError(f"{shlex.join(argv)[:300]} failed (exit {done.returncode}); "
                             f"the end of {self.log_path}:\n{tail}")
        return done.stdout or ""

    def buildah(self, *args: str, capture: bool = True) -> str:
        return self.sh(["buildah", "--root", str(self.store / "root"), "--runroot", str(self.store / "runroot"),
                        "--storage-driver", "vfs", *args], capture=capture).strip()

    def has_image(self, ref: str) -> bool:
        try:
            self.buildah("inspect", "--type", "image", ref)
        except BuildError:
            return False
        return True

    def in_root(self, mnt: Path, command: str, *, env: Mapping[str, str], user: str | None = None,
                binds: Mapping[str, Path] | None = None, capture: bool = False) -> str:
        """`command` (sh) in a chroot of `mnt`, with /dev, /proc and `binds` (read-only) mounted in a
        private mount namespace: they vanish with the command, so none can outlive it in the layer."""
        script = ['set -e', 'mount --bind /dev "$1/dev"', 'mount -t proc proc "$1/proc"']
        for target, source in (binds or {}).items():
            script.append(f'mount --bind -o ro {shlex.quote(str(source))} "$1"/{shlex.quote(target)}')
        script.append('shift; exec chroot "$@"')
        chroot = [*([f"--userspec={user}"] if user else []), str(mnt), "/bin/sh", "-c", command]
        return self.sh(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                        "\n".join(script), "sh", str(mnt), *chroot], env=env, capture=capture)

    def step_env(self, **extra: str) -> dict[str, str]:
        return {"PATH": self.image.env["PATH"], "HOME": "/root", "LANG": "C.UTF-8",
                **self.image.build_env, **self.build_args, **extra}

    @contextlib.contextmanager
    def container(self, source: str) -> Iterator[tuple[str, Path]]:
        """A working container from image `source` (or scratch), mounted; removed afterwards."""
        name = self.buildah("from", "--pull=never", source) if source != "scratch" else self.buildah("from", source)
        try:
            yield name, Path(self.buildah("mount", name))
        finally:
            mnt = Path(self.buildah("mount", name))
            if _mounts_under(mnt):  # never reached: the chroot's mounts live in their own namespace
                raise BuildError(f"{mnt} still has mounts under it ({_mounts_under(mnt)}); not removing it")
            self.buildah("rm", name)

    def commit(self, name: str, ref: str) -> None:
        self.buildah("commit", "--format", "oci", name, ref)

    # --- wheels ---

    def pip(self, *args: str) -> None:
        self.sh([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])

    def pip_for_image(self, python: Mapping[str, str], *args: str) -> None:
        """The host's pip downloading for the image's interpreter (tags, Requires-Python and markers)."""
        version = python["python_full_version"]
        abi = "cp" + "".join(version.split(".")[:2])
        self.sh([sys.executable, "-c", PIP_FOR_IMAGE, json.dumps(dict(python)), "--disable-pip-version-check",
                 *args, "--only-binary=:all:", "--python-version", version, "--implementation", "cp",
                 "--abi", abi, *(f"--platform={p}" for p in PLATFORMS)])

    def wheels(self, layer: description.Layer, python: Mapping[str, str]) -> Path:
        """The layer's wheels, downloaded once per requirements (into a temporary folder, then renamed)."""
        index = self.build_args.get(layer.index_arg, "") if layer.index_arg else ""
        folder = self.cache / "wheels" / wheels_key(layer, index, python)
        if (folder / ".done").exists():
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".partial-") as tmp:
            index_args = ["--index-url", index] if index else []
            if layer.requires:
                self.pip_for_image(python, "download", "--dest", tmp, *index_args, *layer.requires)
            if layer.requires_no_deps:
                self.pip_for_image(python, "download", "--no-deps", "--dest", tmp, *layer.requires_no_deps)
            Path(tmp, ".done").touch()
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)
        return folder

    def project_wheel(self, into: Path) -> None:
        """The project's wheel, built from a copy of the hashed files (never in the checkout)."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in self.files.items():
                if name.split("/")[0] in description.PROJECT_INPUTS:
                    path = Path(tmp, name)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
            self.pip("wheel", "--no-deps", *_build_isolation(), "--wheel-dir", str(into), tmp)

    # --- layers ---

    def base(self) -> str:
        ref = f"{LAYER_REPO}/base:{_short(base_key(self.image))}"
        if self.has_image(ref):
            return ref
        base = self.image.base
        with self.container("scratch") as (name, mnt):
            self.sh(["unshare", "--mount", "--propagation", "private", "--", "debootstrap", "--variant=minbase",
                     f"--include={','.join(base.packages)}", base.suite, str(mnt), base.mirror])
            self.in_root(mnt, " && ".join([*base.setup, *base.strip]), env=self.step_env())
            for leftover in ("etc/resolv.conf", "etc/hostname"):  # the build host's, not the image's
                (mnt / leftover).unlink(missing_ok=True)
            _empty(mnt / "dev")  # the runtime mounts its own /dev
            self.buildah("config", "--created-by", f"debootstrap {base.suite} + {', '.join(base.packages)}", name)
            self.python_file(ref).write_text(self.in_root(mnt, f"python3 -c {shlex.quote(MARKER_ENVIRONMENT)}",
                                                          env=self.step_env(), capture=True))
            self.commit(name, ref)
        return ref

    def python_file(self, base: str) -> Path:
        return self.store / f"{base.rsplit(':', 1)[1]}.python.json"

    def python(self, base: str) -> dict[str, str]:
        """The base image's interpreter as markers see it (read when the base was built)."""
        path = self.python_file(base)
        if not path.exists():
            with self.container(base) as (_, mnt):
                path.write_text(self.in_root(mnt, f"python3 -c {shlex.quote(MARKER_ENVIRONMENT)}",
                                             env=self.step_env(), capture=True))
        return json.loads(path.read_text())

    def install(self, name: str, mnt: Path, layer: description.Layer, binds: Mapping[str, Path]) -> None:
        """Runs `layer`'s steps in the working container `name` (mounted at `mnt`), wheels bound in."""
        steps = layer.steps(self.image.project)
        for target in binds:
            (mnt / target).mkdir(parents=True)
        env = self.step_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=" ".join(f"/{t}" for t in binds))
        self.in_root(mnt, " && ".join(steps), env=env, binds=binds)
        for target in binds:
            (mnt / target).rmdir()
        shutil.rmtree(mnt / "root" / ".cache", ignore_errors=True)
        self.buildah("config", "--created-by", " && ".join(steps), name)

    def torch(self, parent: str, layer: description.Layer, wheels: Path) -> str:
        """The torch layer's image, committed under its own key unless it is there already."""
        names = sorted(p.name for p in wheels.glob("*.whl"))
        ref = f"{LAYER_REPO}/{layer.name}:{_short(layer_key(parent, layer, self.build_args, names))}"
        if not self.has_image(ref):
            with self.container(parent) as (name, mnt):
                self.install(name, mnt, layer, {"tmp/wheels": wheels})
                self.commit(name, ref)
        return ref

    def check(self, mnt: Path) -> dict[str, Any]:
        uid = self.image.user.split(":")[0]
        home = mnt / CHECK_HOME.lstrip("/")
        home.mkdir()
        os.chown(home, int(uid), int(uid))
        env = {**self.image.env, "HOME": CHECK_HOME, "LANG": "C.UTF-8"}
        try:
            command = " && ".join([
                f"{shlex.join(self.image.entrypoint)} --help >/dev/null",
                f"python -c {shlex.quote(CHECK)}",
            ])
            report = self.in_root(mnt, command, env=env, user=self.image.user, capture=True)
        finally:
            shutil.rmtree(home)
        with open(self.log_path, "a") as log:
            log.write(f"check: {report}")
        return json.loads(report.strip().splitlines()[-1])

    def configure(self, name: str) -> None:
        image = self.image
        args = [a for key, value in image.env.items() for a in ("--env", f"{key}={value}")]
        args += [a for key, value in image.labels.items() for a in ("--label", f"{key}={value}")]
        args += [a for port in image.ports for a in ("--port", f"{port}/tcp")]
        self.buildah("config", *args, "--user", image.user, "--workingdir", image.workdir,
                     "--entrypoint", json.dumps(list(image.entrypoint)), "--cmd", json.dumps(list(image.cmd)), name)

    def push(self, ref: str, archive: Path) -> int:
        """Writes `ref` as an OCI archive, layers gzipped. Measured on 2 busy cores for the base and
        torch layers (4.5 GB): gzip 77 s -> 2.75 GB, zstd 109 s -> 2.49 GB, none (docker-archive)
        53 s -> 4.5 GB. Most of the time is buildah diffing vfs layers, not compressing, so gzip,
        which every runtime reads, stays. (buildah 1.28 ignores --disable-compression for oci-archive.)"""
        partial = archive.with_name(archive.name + ".partial")
        partial.unlink(missing_ok=True)
        self.buildah("push", ref, f"oci-archive:{partial}:{ref}", capture=False)
        os.replace(partial, archive)
        return archive.stat().st_size

    def pause(self) -> dict[str, Any]:
        source = HERE / "pause.c"
        version = self.sh(["gcc", "--version"], capture=True)
        key = digest({"source": source.read_bytes(), "flags": " ".join(PAUSE_FLAGS), "gcc": version,
                      "format": LAYER_FORMAT})
        ref = f"{PAUSE_NAME}:{_short(key)}"
        if not self.has_image(ref):
            with self.container("scratch") as (name, mnt):
                self.sh(["gcc", *PAUSE_FLAGS, "-o", str(mnt / "pause"), str(source)])
                self.buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535",
                             "--created-by", f"gcc {' '.join(PAUSE_FLAGS)} pause.c", name)
                self.commit(name, ref)
        with self.container(ref) as (_, mnt):
            installed = (mnt / "pause").stat().st_size
        archive = self.result_dir / "pause.oci.tar"
        return {"ref": ref, "archive": str(archive), "archive_bytes": self.push(ref, archive),
                "installed_bytes": installed}

    # --- the whole build ---

    def run(self) -> dict[str, Any]:
        self.log_path.write_text("")
        self.buildah("rm", "--all")  # working containers a failed build left behind
        torch_layer, app_layer = self.image.layers
        with self.step(f"base layer (debootstrap {self.image.base.suite})"):
            base = self.base()
            python = self.python(base)
        with self.step(f"wheels for the torch layer (Python {python['python_full_version']})"):
            torch_wheels = self.wheels(torch_layer, python)
        with self.step("wheels for the app layer (runtime deps, demo model)"):
            app_wheels = self.wheels(app_layer, python)
        self.result_dir.mkdir(parents=True, exist_ok=True)
        ref = f"{self.image.name}:dev-{_short(self.key)}"
        with tempfile.TemporaryDirectory(dir=self.cache) as project_dir:
            with self.step("the project's wheel"):
                self.project_wheel(Path(project_dir))
            with self.step("torch layer"):
                torch_ref = self.torch(base, torch_layer, torch_wheels)
            with contextlib.ExitStack() as stack:
                with self.step("working container from the torch layer"):
                    name, mnt = stack.enter_context(self.container(torch_ref))
                with self.step("app layer: pip install"):
                    self.install(name, mnt, app_layer, {"tmp/wheels": app_wheels, "tmp/project": Path(project_dir)})
                with self.step("check the image as uid 10001"):
                    checked = self.check(mnt)
                self.configure(name)
                installed = _tree_bytes(mnt)
                with self.step("commit the app layer"):
                    self.commit(name, ref)
        archive = self.result_dir / "inferplane.oci.tar"
        with self.step(f"push into {archive.name}"):
            archive_bytes = self.push(ref, archive)
        self.buildah("rmi", ref)  # the archive is the result; the layers below stay for the next build
        with self.step("pause image"):
            pause = self.pause()
        result = {"key": self.key,
                  "image": {"ref": ref, "archive": str(archive), "archive_bytes": archive_bytes,
                            "installed_bytes": installed, "check": checked},
                  "pause": pause}
        (self.result_dir / "image.json").write_text(json.dumps(result, sort_keys=True) + "\n")
        self.prune(keep={base, torch_ref, pause["ref"]}, wheels={torch_wheels, app_wheels})
        return result

    def prune(self, keep: set[str], wheels: set[Path]) -> None:
        """Drops what this build did not use: layer images, wheels, and all but the newest results
        (a source change then costs the app layer only; a torch or base change, a download)."""
        listed = json.loads(self.buildah("images", "--json") or "[]")
        for entry in listed:
            names = entry.get("names") or []
            ours = [n for n in names if n.startswith((LAYER_REPO, PAUSE_NAME, self.image.name))]
            if ours and not keep.intersection(names):
                self.buildah("rmi", "--force", entry["id"])
        kept_tags = {ref.rsplit(":", 1)[1] for ref in keep}
        for sidecar in self.store.glob("*.python.json"):
            if sidecar.name.removesuffix(".python.json") not in kept_tags:
                sidecar.unlink()
        for folder in (self.cache / "wheels").iterdir():
            if folder not in wheels:
                shutil.rmtree(folder)
        results = sorted((p for p in (self.cache / "images").iterdir() if p.is_dir()),
                         key=lambda p: ((p / "image.json").exists(), p.stat().st_mtime), reverse=True)
        for old in results[KEEP_RESULTS:]:
            shutil.rmtree(old)


def _build_isolation() -> list[str]:
    """--no-build-isolation where this Python's setuptools can build the project (no download)."""
    try:
        from importlib.metadata import version

        major = int(version("setuptools").split(".")[0])
    except Exception:  # no setuptools, or an odd version: let pip fetch a build backend
        return []
    return ["--no-build-isolation"] if major >= 70 else []


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == str(path) or p.startswith(prefix)]


def _empty(folder: Path) -> None:
    if os.path.ismount(folder) or _mounts_under(folder):
        raise BuildError(f"{folder} is a mount point; not emptying it")
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under `root` (each hard link once), as `du -sb` counts apparent sizes."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _cached(cache: Path, key: str) -> dict[str, Any] | None:
    record = cache / "images" / key / "image.json"
    if not record.exists():
        return None
    result = json.loads(record.read_text())
    if all(Path(result[part]["archive"]).exists() for part in ("image", "pause")):
        return result
    return None


def _missing_tools() -> list[str]:
    return [tool for tool in ("debootstrap", "buildah", "gcc", "chroot", "unshare", "mount")
            if shutil.which(tool) is None]


def build_images(cache_dir: Path | str | None = None, *, build_args: Mapping[str, str] | None = None,
                 out: TextIO | None = None) -> dict[str, Any]:
    """Builds (or finds cached) the inferplane and pause images; returns what the JSON line says.

    Raises BuildError when a step fails or the machine cannot build (not root, a tool missing)."""
    out = out or sys.stderr
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    image = description.describe(ROOT)
    unknown = set(build_args or {}) - set(image.build_args)
    if unknown:
        raise BuildError(f"unknown build argument(s) {sorted(unknown)}; known: {sorted(image.build_args)}")
    args = {**image.build_args, **(build_args or {})}
    files = input_files(ROOT)
    key = image_key(image, files, args)
    cached = _cached(cache, key)
    if cached is not None:
        out.write(f"image: reusing {cached['image']['ref']} ({cache / 'images' / key})\n")
        return cached
    if os.geteuid() != 0:
        raise BuildError("building the image needs root (debootstrap, chroot, mounts and buildah's storage): "
                         f"sudo {sys.executable} {Path(__file__).relative_to(ROOT)}")
    missing = _missing_tools()
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install debootstrap buildah gcc libc6-dev")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second one then finds the first's result
        cached = _cached(cache, key)
        if cached is not None:
            return cached
        start = time.monotonic()
        builder = Builder(cache, image, args, files, key, out)
        result = builder.run()
        out.write(f"image: built {result['image']['ref']} in {time.monotonic() - start:.0f} s\n")
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"cache folder (default ${CACHE_ENV} or ~/.cache/inferplane/images)")
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="as docker build's, e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu")
    args = parser.parse_args(argv)
    build_args = dict(a.split("=", 1) for a in args.build_arg)
    try:
        result = build_images(args.out, build_args=build_args)
    except BuildError as exc:
        print(f"image: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
