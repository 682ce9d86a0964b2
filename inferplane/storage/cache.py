"""The per-node model cache's layout, shared by the fetcher (which fills it) and the operator (which
computes the worker's `--model` path from a digest without fetching anything).

    <root>/<sha256>/<basename>   a cached file (a GGUF keeps its name, so tools that look at it can)
    <root>/<sha256>/model/       a cached Hugging Face folder (a fixed name: a prefix's last component
                                 says nothing useful, and the operator need not know it)
    <root>/.partial/<key>/       downloads in progress, resumed by the next attempt
    <root>/.tmp/<key>-<random>/  fully downloaded data being verified, then renamed to <root>/<sha256>
    <root>/.locks/<key>.lock     one fetcher per key at a time (`fcntl.flock`)

A completed entry `<root>/<sha256>/` is only ever created by renaming a verified temp directory into
place, which is atomic on one file system: a reader (another pod on the node) sees either no entry or
a complete, verified one. So "the entry exists" is the whole cache-hit test and needs no lock.
A `key` is a digest, or "uri-<sha256 of the URI>" while the digest is not known yet.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from inferplane.storage.uris import ModelURI, parse_model_uri

CACHE_ENV = "INFERPLANE_MODEL_CACHE"
FOLDER_NAME = "model"
PARTIAL_DIR, TMP_DIR, LOCKS_DIR = ".partial", ".tmp", ".locks"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_KEY_RE = re.compile(r"^(uri-)?[0-9a-f]{64}$")


def default_cache_root() -> Path:
    """$INFERPLANE_MODEL_CACHE, else ~/.cache/inferplane/models."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "inferplane" / "models"


def check_sha256(sha256: str) -> str:
    """A digest as the cache keys it: 64 lowercase hex digits (upper case is accepted and folded).
    Anything else is a `ValueError`: the digest becomes a directory name, so it must not be a path."""
    folded = sha256.strip().lower() if isinstance(sha256, str) else ""
    if not _SHA256_RE.match(folded):
        raise ValueError(f"invalid sha256 {sha256!r}: expected 64 hex digits")
    return folded


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key):
        raise ValueError(f"invalid cache key {key!r}")
    return key


def entry_dir(cache_root: Path | str, sha256: str) -> Path:
    """`<root>/<sha256>`: the completed entry's directory."""
    return Path(cache_root) / check_sha256(sha256)


def cached_path(cache_root: Path | str, sha256: str, uri: ModelURI | str, *, folder: bool) -> Path:
    """Where the weights of digest `sha256`, fetched from `uri`, are once cached: `<root>/<sha256>/model`
    for a folder, `<root>/<sha256>/<basename of uri>` for a file. Pure: touches no file system, so the
    operator can put it in a pod spec. (A `Path`, which on the POSIX nodes we run on is a `PurePosixPath`.)"""
    name = FOLDER_NAME if folder else (uri if isinstance(uri, ModelURI) else parse_model_uri(uri)).basename
    return entry_dir(cache_root, sha256) / name


def lookup(cache_root: Path | str, sha256: str, basename: str) -> Path | None:
    """The cached weights of `sha256`, or None. A folder entry answers with its `model/` directory; a
    file entry with `<basename>`. When the same bytes were cached under another URI's name, a hard
    link with this name is added (atomic, same entry), so `cached_path` holds for every URI."""
    entry = entry_dir(cache_root, sha256)
    if not entry.is_dir():
        return None
    if (entry / FOLDER_NAME).is_dir():
        return entry / FOLDER_NAME
    wanted = entry / basename
    if wanted.is_file():
        return wanted
    other = next((p for p in sorted(entry.iterdir()) if p.is_file()), None)
    if other is None:
        return None
    with contextlib.suppress(FileExistsError):
        os.link(other, wanted)
    return wanted


def partial_dir(cache_root: Path | str, key: str) -> Path:
    """`<root>/.partial/<key>`: where an unfinished download lies, to be resumed (created if needed)."""
    path = Path(cache_root) / PARTIAL_DIR / _check_key(key)
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_tmp_dir(cache_root: Path | str, key: str) -> Path:
    """A fresh `<root>/.tmp/<key>-<random>/`, on the cache's file system so the commit is a rename."""
    tmp_root = Path(cache_root) / TMP_DIR
    tmp_root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{_check_key(key)}-", dir=tmp_root))


def keep_only(folder: Path, name: str) -> None:
    """Removes everything in `folder` but `name`: leftovers of an attempt at another shape (a file
    where there is now a folder, another URI's name) would otherwise end up in the entry."""
    for child in folder.iterdir():
        if child.name != name:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def remove_stale_tmp(cache_root: Path | str, key: str) -> None:
    """Removes temp directories a killed fetcher of `key` left. Call only while holding `lock(key)`:
    then no live fetcher owns them."""
    tmp_root = Path(cache_root) / TMP_DIR
    if tmp_root.is_dir():
        for stale in tmp_root.glob(f"{_check_key(key)}-*"):
            shutil.rmtree(stale, ignore_errors=True)


def commit(cache_root: Path | str, sha256: str, tmp: Path) -> Path:
    """Renames the verified `tmp` directory to `<root>/<sha256>` (atomic). If the entry exists already
    (another fetcher under a different key got there first), `tmp` is discarded and the entry kept.
    Returns the entry directory."""
    entry = entry_dir(cache_root, sha256)
    os.chmod(tmp, 0o755)  # mkdtemp made it 0700: workers in other containers (other UIDs) must read it
    try:
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


@contextlib.contextmanager
def lock(cache_root: Path | str, key: str) -> Iterator[None]:
    """Holds the exclusive lock of `key`, waiting for it. `flock` locks belong to an open file
    description, so this excludes other processes (pods on the node, sharing the host path) and other
    threads of this one alike, and the kernel releases it when a holder dies. Lock files stay: deleting
    one while a waiter holds it open would let two fetchers in."""
    locks = Path(cache_root) / LOCKS_DIR
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{_check_key(key)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
