"""Adapters read from their folders, kept in host memory by name and file version, so a request
for an adapter that was served before costs a dictionary lookup, not a read and a check.

A refusal is kept the same way: an adapter whose files fail the check (api/lora_manifest.py) is
not read again for each request that names it, until one of its two files changes (a file's
identity here: device, inode, size, modification and change times). Reading a tenant's files costs
the worker CPU (and the GIL) that other tenants' streams share, so a bad adapter costs one read.

Thread-safe: the async engine reads adapters on its pool, off the engine thread (a slot load is
then only a copy), and the offline LLM reads them on its own thread.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.lora.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    LoraAdapter,
    LoraRequest,
    load_adapter,
)

FileIdentity = tuple[int, int, int, int, int] | None  # (device, inode, size, mtime_ns, ctime_ns); None: absent


def file_identity(path: Path) -> FileIdentity:
    """What tells one version of a file from another without reading it (stat never blocks on a FIFO)."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return None
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


class AdapterCatalog:
    def __init__(self, base: ModelConfig, max_rank: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 64, refusals: int = 256):
        self.base = base
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.capacity = capacity  # adapters kept in host memory, least recently used dropped first
        self._kept: OrderedDict[tuple, LoraAdapter] = OrderedDict()
        self.refusals = refusals  # refused adapters remembered, least recently used dropped first
        self._refused: OrderedDict[tuple, str] = OrderedDict()  # same key -> the AdapterError's message
        self._lock = threading.Lock()
        self.reads = 0

    @classmethod
    def for_engine(cls, engine) -> AdapterCatalog:
        """The catalog of adapters that fit `engine`: its base model, rank limit, dtype and device."""
        return cls(engine.loaded.config, engine.options.max_lora_rank, engine.dtype, engine.device)

    def get(self, request: LoraRequest) -> LoraAdapter:
        """The adapter `request` names, read again only when one of its files changed; a refusal
        (AdapterError) is answered again from memory until then."""
        folder = Path(request.path)
        weights = file_identity(folder / WEIGHTS_FILE)
        if weights is None:
            raise AdapterError(f"adapter {request.name!r}: {WEIGHTS_FILE} is missing in {request.path}")
        key = (request.name, str(folder.resolve()), weights, file_identity(folder / CONFIG_FILE))
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
            refused = self._refused.get(key)
            if refused is not None:
                self._refused.move_to_end(key)
                raise AdapterError(refused)
        try:
            adapter = load_adapter(request, self.base, self.max_rank, self.dtype, "cpu")
        except AdapterError as exc:
            with self._lock:
                self.reads += 1
                self._refused[key] = str(exc)
                while len(self._refused) > self.refusals:
                    self._refused.popitem(last=False)
            raise
        with self._lock:
            self.reads += 1
            self._kept[key] = adapter
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return adapter
