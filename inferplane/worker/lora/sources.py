"""Where a worker gets an adapter a request names: its URI fetched into the node's digest cache
(the path models take, storage.fetch_model: file, http(s), s3, sha256 verified), then read through
the catalog. Runs on a worker thread, never on the engine thread or the event loop.

A URI verified against a digest once is not hashed again for every request: the (uri, sha256)
pair is remembered with the path it resolved to; the catalog notices a changed file by itself.
"""

from __future__ import annotations

import threading
from pathlib import Path

from inferplane.storage.cache import default_cache_root
from inferplane.storage.errors import FetchError
from inferplane.storage.fetch import fetch_model
from inferplane.worker.lora.adapter import AdapterError, LoraAdapter, LoraRequest
from inferplane.worker.lora.catalog import AdapterCatalog


class AdapterSource:
    def __init__(self, catalog: AdapterCatalog, cache_root: Path | str | None = None,
                 s3_endpoint_url: str | None = None):
        self.catalog = catalog
        self.cache_root = Path(cache_root) if cache_root is not None else default_cache_root()
        self.s3_endpoint_url = s3_endpoint_url
        self._paths: dict[tuple[str, str], Path] = {}
        self._lock = threading.Lock()

    def adapter(self, name: str, uri: str, sha256: str = "") -> LoraAdapter:
        """The adapter `name` at `uri` (verified against `sha256` where given), read and checked;
        AdapterError naming the adapter where it cannot be had."""
        if not name or not uri:
            raise AdapterError("adapter: name and uri are both required")
        key = (uri, sha256)
        with self._lock:
            path = self._paths.get(key)
        if path is None:
            try:
                path = fetch_model(uri, self.cache_root, sha256=sha256 or None,
                                   s3_endpoint_url=self.s3_endpoint_url).path
            except (ValueError, FetchError) as exc:
                raise AdapterError(f"adapter {name!r}: {exc}") from None
            if sha256:  # verified: later requests skip the hashing
                with self._lock:
                    self._paths[key] = path
        return self.catalog.get(LoraRequest(name, str(path)))
