"""Adapters read from their folders, kept in host memory by name and file version, so a request
for an adapter that was served before costs a dictionary lookup, not a read and a check.

Thread-safe: the async engine reads adapters on its pool, off the engine thread (a slot load is
then only a copy), and the offline LLM reads them on its own thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.lora.adapter import WEIGHTS_FILE, AdapterError, LoraAdapter, LoraRequest, load_adapter


class AdapterCatalog:
    def __init__(self, base: ModelConfig, max_rank: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 64):
        self.base = base
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.capacity = capacity  # adapters kept in host memory, least recently used dropped first
        self._kept: OrderedDict[tuple, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0

    @classmethod
    def for_engine(cls, engine) -> AdapterCatalog:
        """The catalog of adapters that fit `engine`: its base model, rank limit, dtype and device."""
        return cls(engine.loaded.config, engine.options.max_lora_rank, engine.dtype, engine.device)

    def get(self, request: LoraRequest) -> LoraAdapter:
        """The adapter `request` names, read again only when its weights file changed."""
        weights = Path(request.path) / WEIGHTS_FILE
        try:
            stat = weights.stat()
        except OSError:
            raise AdapterError(f"adapter {request.name!r}: {WEIGHTS_FILE} is missing in {request.path}") from None
        key = (request.name, str(Path(request.path).resolve()), stat.st_mtime_ns, stat.st_size)
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
        adapter = load_adapter(request, self.base, self.max_rank, self.dtype, "cpu")
        with self._lock:
            self.reads += 1
            self._kept[key] = adapter
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return adapter
