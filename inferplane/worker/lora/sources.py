"""Where a worker gets an adapter a request names: its URI fetched into the node's digest cache
(the path models take, storage.fetch_model: file, http(s), s3, sha256 verified), then read through
the catalog. Runs on a worker thread, never on the engine thread or the event loop.

A URI verified against a digest once is not hashed again for every request: the (uri, sha256)
pair is remembered with the path it resolved to; the catalog notices a changed file by itself.
A local folder that does not match its digest is not hashed again either, until a file in it
changes; a refused adapter's files are not parsed again (catalog.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from inferplane.storage.cache import default_cache_root
from inferplane.storage.digest import folder_files
from inferplane.storage.errors import DigestMismatch, FetchError
from inferplane.storage.fetch import fetch_model
from inferplane.storage.uris import parse_model_uri
from inferplane.worker.lora.adapter import AdapterError, LoraAdapter, LoraRequest
from inferplane.worker.lora.catalog import AdapterCatalog, file_identity

_MISMATCHES_KEPT = 256


def _local_version(uri: str) -> tuple | None:
    """The identities of a local URI's files (no read), or None for a remote URI or a bad one."""
    try:
        parsed = parse_model_uri(uri)
    except ValueError:
        return None
    if parsed.scheme != "file" or not parsed.path:
        return None
    path = Path(parsed.path)
    files = folder_files(path) if path.is_dir() else [path]
    return tuple((str(f), file_identity(f)) for f in files)


class AdapterSource:
    def __init__(self, catalog: AdapterCatalog, cache_root: Path | str | None = None,
                 s3_endpoint_url: str | None = None):
        self.catalog = catalog
        self.cache_root = Path(cache_root) if cache_root is not None else default_cache_root()
        self.s3_endpoint_url = s3_endpoint_url
        self._paths: dict[tuple[str, str], Path] = {}
        self._mismatched: OrderedDict[tuple, str] = OrderedDict()  # (uri, sha256, files' identities) -> why
        self._lock = threading.Lock()

    def adapter(self, name: str, uri: str, sha256: str = "") -> LoraAdapter:
        """The adapter `name` at `uri` (verified against `sha256` where given), read and checked;
        AdapterError naming the adapter where it cannot be had."""
        if not name or not uri:
            raise AdapterError("adapter: name and uri are both required")
        if "\x00" in name or "\x00" in uri:
            raise AdapterError("adapter: the name and uri must not hold a NUL byte")
        key = (uri, sha256)
        with self._lock:
            path = self._paths.get(key)
        if path is None:
            path = self._fetch(name, uri, sha256)
        return self.catalog.get(LoraRequest(name, str(path)))

    def _fetch(self, name: str, uri: str, sha256: str) -> Path:
        version = _local_version(uri) if sha256 else None
        mismatch_key = (uri, sha256, version)
        if version is not None:
            with self._lock:
                known = self._mismatched.get(mismatch_key)
            if known is not None:  # the same local files failed their digest before: not hashed again
                raise AdapterError(known)
        try:
            path = fetch_model(uri, self.cache_root, sha256=sha256 or None, s3_endpoint_url=self.s3_endpoint_url).path
        except DigestMismatch as exc:
            message = f"adapter {name!r}: {exc}"
            if version is not None:
                with self._lock:
                    self._mismatched[mismatch_key] = message
                    while len(self._mismatched) > _MISMATCHES_KEPT:
                        self._mismatched.popitem(last=False)
            raise AdapterError(message) from None
        except (ValueError, FetchError) as exc:
            raise AdapterError(f"adapter {name!r}: {exc}") from None
        if sha256:  # verified: later requests skip the hashing
            with self._lock:
                self._paths[(uri, sha256)] = path
        return path
