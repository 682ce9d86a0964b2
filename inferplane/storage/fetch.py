"""`fetch_model`: the weights of a model URI, on this node, verified against their digest.

Workers load weights only through this: a cached entry is complete and verified by construction
(see `cache`), a download is verified before it becomes an entry, and local paths are verified in
place. Knowing the digest up front (the registry recorded it) makes a cache hit a directory check
with no network at all; without one (registering a remote URI) the download is what tells it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inferplane.storage import cache
from inferplane.storage.digest import digest, size_bytes
from inferplane.storage.errors import DigestMismatch, FetchError
from inferplane.storage.uris import ModelURI, parse_model_uri

if TYPE_CHECKING:
    import httpx

__all__ = ["DigestMismatch", "FetchError", "FetchResult", "fetch_model"]


@dataclass(frozen=True)
class FetchResult:
    """Where the weights are, what they are, and what getting them cost."""

    path: Path  # the file or folder to load (`--model`)
    sha256: str  # verified: the expected digest, or the computed one when none was given
    size_bytes: int
    downloaded: bool  # False for a cache hit or a local path
    fetch_seconds: float
    verify_seconds: float


def fetch_model(uri: str, cache_root: Path | str, *, sha256: str | None = None,
                s3_endpoint_url: str | None = None, timeout: float = 60,
                http_transport: httpx.BaseTransport | None = None) -> FetchResult:
    """The weights at `uri`, fetched into `cache_root` (unless cached already) and verified.

    `sha256` is the digest the registry recorded; a download that does not match is deleted and
    raises `DigestMismatch`. Without it the digest is computed and the entry keyed by it.
    A file URI (or absolute path) is not copied: the weights are already on this node, and a copy
    would only double the disk they take; it is verified in place. A pvc:// URI is a `ValueError`:
    the operator mounts the claim and the caller passes the mounted path as a file URI.
    `timeout` bounds each network wait (connect, each read), not the whole transfer.
    `http_transport` carries http(s) downloads (the registry's refuses internal addresses).
    Raises `ValueError` (bad URI or digest), `FetchError` (the network or the store said no).
    """
    parsed = parse_model_uri(uri)
    expected = cache.check_sha256(sha256) if sha256 is not None else None
    if parsed.scheme == "pvc":
        raise ValueError(f"cannot fetch {uri}: a pvc:// claim is mounted by the operator, not fetched; "
                         "pass the mounted path as a file URI")
    if parsed.scheme == "file":
        return _local(parsed, expected)
    root = Path(cache_root).expanduser()
    if expected is None:
        key = "uri-" + hashlib.sha256(parsed.text.encode()).hexdigest()
    else:
        key = expected
        hit = cache.lookup(root, expected, parsed.basename)
        if hit is not None:
            return _cached(hit, expected)
    with cache.lock(root, key):
        if expected is not None:
            hit = cache.lookup(root, expected, parsed.basename)  # another fetcher finished while we waited
            if hit is not None:
                return _cached(hit, expected)
        cache.remove_stale_tmp(root, key)
        started = time.perf_counter()
        content = _download(parsed, cache.partial_dir(root, key), s3_endpoint_url=s3_endpoint_url, timeout=timeout,
                            http_transport=http_transport)
        return _verify_and_commit(root, key, parsed, content, expected, time.perf_counter() - started)


def _local(uri: ModelURI, expected: str | None) -> FetchResult:
    path = Path(uri.path or "")
    if not path.exists():
        raise FetchError(f"fetching {uri} failed: no such file or folder {path}")
    started = time.perf_counter()
    actual = digest(path)
    verify_seconds = time.perf_counter() - started
    if expected is not None and actual != expected:
        raise DigestMismatch(uri.text, expected, actual)
    return FetchResult(path, actual, size_bytes(path), False, 0.0, verify_seconds)


def _cached(path: Path, sha256: str) -> FetchResult:
    return FetchResult(path, sha256, size_bytes(path), False, 0.0, 0.0)


def _download(uri: ModelURI, partial: Path, *, s3_endpoint_url: str | None, timeout: float,
              http_transport: httpx.BaseTransport | None = None) -> Path:
    """Downloads (resuming) into `partial`; returns the downloaded file or folder inside it."""
    if uri.scheme == "s3":
        from inferplane.storage.s3_source import download_s3

        return download_s3(uri, partial, endpoint_url=s3_endpoint_url, timeout=timeout)
    from inferplane.storage.http_source import download_http

    cache.keep_only(partial, uri.basename)
    download_http(uri.url or "", partial / uri.basename, timeout=timeout, transport=http_transport)
    return partial / uri.basename


def _verify_and_commit(root: Path, key: str, uri: ModelURI, content: Path, expected: str | None,
                       fetch_seconds: float) -> FetchResult:
    """Moves the finished download into a fresh temp directory, verifies it there, and renames that
    into place as the entry. On a mismatch (or any error) the temp directory, and so the download,
    is deleted: bytes that failed verification are not worth resuming."""
    tmp = cache.new_tmp_dir(root, key)
    try:
        staged = tmp / content.name
        os.rename(content, staged)
        shutil.rmtree(content.parent, ignore_errors=True)  # the partial directory, now empty
        started = time.perf_counter()
        actual = digest(staged)
        verify_seconds = time.perf_counter() - started
        if expected is not None and actual != expected:
            raise DigestMismatch(uri.text, expected, actual)
        size = size_bytes(staged)
        # Keyed by the URI, the entry's lock is not held yet; keyed by the digest, it is (and flock
        # would not let this thread take it twice).
        with cache.lock(root, actual) if key != actual else contextlib.nullcontext():
            cache.commit(root, actual, tmp)
            path = cache.lookup(root, actual, content.name)
        if path is None:  # the entry that was there first holds something else: cannot happen for one digest
            raise FetchError(f"fetching {uri} failed: cache entry {cache.entry_dir(root, actual)} is unusable")
        return FetchResult(path, actual, size, True, fetch_seconds, verify_seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when committed
