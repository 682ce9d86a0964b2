"""The KV tiers an engine is given, from its options: which model's KV a stored block is, and the
store and the link to the pool (engine/kv/tiers/).

A block's KV depends on the weights and on how they are served: the same file under the float
runtimes and under cpu-int8 (whose conversion, smoothing and kernels change the numbers) gives
other KV. So the layout's `model_digest` hashes the weights' bytes with the runtime, the compute
dtype, the weight format settings and, on int8, the conversion's code: a worker after an upgrade
that changes any of them finds the disk tier's old blocks foreign (misses), never wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from inferplane.storage.digest import digest
from inferplane.worker.engine.kv.tiers.layout import KVLayout
from inferplane.worker.engine.kv.tiers.link import TierLink
from inferplane.worker.engine.kv.tiers.store import open_tiers
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.model.loader import LoadedModel
from inferplane.worker.ops.kv_cache import PagedKVCache
from inferplane.worker.quant import startup_cache

log = logging.getLogger(__name__)


def weights_digest(path: str) -> str:
    """The registry's digest of the weights (storage/digest.py: a file's sha256, or a folder's
    manifest sum); a single file's is remembered by (path, size, mtime) in the start-up cache where
    there is one, so a restart does not read the weights again."""
    directory = startup_cache.cache_dir()
    if directory is not None and Path(path).is_file():
        return startup_cache.file_digest(str(path), directory)
    return digest(path)


def kv_identity(loaded: LoadedModel, options: EngineOptions, dtype: torch.dtype) -> str:
    """The `model_digest` of the layout: the weights and everything that changes the KV they give."""
    int8 = options.runtime == "cpu-int8"
    facts = {"weights": weights_digest(loaded.path), "runtime": options.runtime, "dtype": str(dtype),
             "requantize_q4": options.requantize_q4 if int8 else None,
             "code": startup_cache.conversion_code_hash() if int8 else None}
    return "sha256:" + hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def open_tier_link(loaded: LoadedModel, options: EngineOptions, cache: PagedKVCache, dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> TierLink | None:
    """The engine's tiers (None where the options turn none on)."""
    memory, disk = options.offload_sizes()
    if not memory and not disk:
        return None
    shape = cache.data.shape  # [layers, 2, blocks (+ scratch), block_size, kv_heads, head_dim]
    layout = KVLayout(model_digest=kv_identity(loaded, options, dtype), dtype=str(kv_dtype).removeprefix("torch."),
                      block_size=shape[3], layers=shape[0], kv_heads=shape[4], head_dim=shape[5],
                      window_layers=len(cache.window_layers))
    store = open_tiers(layout, memory_bytes=memory, disk_root=options.kv_offload_dir if disk else None,
                       disk_bytes=disk)
    if store.disk is not None and store.disk.found:
        log.info("KV disk tier %s: %d blocks found from earlier workers", store.disk.directory, store.disk.found)
    return TierLink(store, cache)


