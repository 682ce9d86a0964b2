"""The tiers in order: host memory, then disk.

A block is `put` into memory and written through to disk; what memory evicts and the disk lacks
(its own eviction dropped it) spills there again; what the disk evicts is gone. `get` looks in
memory, then on disk, and moves a disk hit back to memory (a block just read is the likeliest to
be read again: the next turn of the same conversation). Every read is checked against the layout
and the block's key (record.py); a record that fails is removed from its tier and counted as a
miss, with its reason.

One lock guards both tiers: blocks are put from the engine's thread and read ahead from the
serving side's prepare pool (`prefetch`, whose file reads run outside the lock), so that a
sequence waiting for its KV never holds up the step.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferplane.api.kv_blocks import Medium
from inferplane.worker.engine.kv.events import KVEventLog
from inferplane.worker.engine.kv.tiers.disk_tier import DiskTier
from inferplane.worker.engine.kv.tiers.layout import KVLayout
from inferplane.worker.engine.kv.tiers.memory_tier import MemoryTier
from inferplane.worker.engine.kv.tiers.record import HEADER, Miss, Part, decode, encode

# What a disk tier without a memory tier above it holds of prefetched records at most (the oldest
# go first; they are still on disk); the worker's memory footprint counts it (api/footprint.py).
STAGED_BYTES = 64 << 20


def open_tiers(layout: KVLayout, *, memory_bytes: int = 0, disk_root: str | os.PathLike[str] | None = None,
               disk_bytes: int = 0) -> TieredKVStore:
    """The store for `layout`: a memory tier of `memory_bytes` (none if 0) and, given a root, a
    disk tier of `disk_bytes` in the root's folder for this layout, so that workers of other models
    or settings sharing the root neither read nor evict each other's blocks."""
    memory = MemoryTier(memory_bytes) if memory_bytes > 0 else None
    disk = DiskTier(Path(disk_root) / layout.fingerprint().hex(), disk_bytes) if disk_root is not None else None
    return TieredKVStore(layout, memory, disk)


def record_name(key: bytes, part: Part) -> bytes:
    """A record's name in a tier: the block's key and which pool's layers it holds."""
    return key + bytes([part])


@dataclass
class TierCounters:
    hits: Counter[str] = field(default_factory=Counter)  # by tier name
    misses: int = 0  # not held by any tier
    rejected: Counter[str] = field(default_factory=Counter)  # held, but failed a check: by reason
    stored: Counter[str] = field(default_factory=Counter)  # records written, by tier name
    evicted: Counter[str] = field(default_factory=Counter)  # records dropped for room, by tier name
    prefetched: int = 0  # records read from disk ahead of their request, off the engine's thread
    read_seconds: Counter[str] = field(default_factory=Counter)  # time `get` took for each hit, by tier


class TieredKVStore:
    """Blocks of one `layout` in a memory tier and (optionally) a disk tier below it."""

    def __init__(self, layout: KVLayout, memory: MemoryTier | None = None, disk: DiskTier | None = None):
        if memory is None and disk is None:
            raise ValueError("a tiered store needs a memory tier, a disk tier or both")
        self.layout = layout
        self.memory = memory
        self.disk = disk
        self.counters = TierCounters()
        self._lock = threading.Lock()
        # Prefetched without a memory tier, until their `get`; the oldest go first past STAGED_BYTES
        # (an aborted request's): they are still on disk, only the read ahead is lost.
        self._staged: OrderedDict[bytes, bytes] = OrderedDict()
        self._staged_bytes = 0
        self.events: KVEventLog | None = None  # set by `publish_to`

    def publish_to(self, events: KVEventLog) -> None:
        """Publishes from now on which blocks each tier holds (kv/events.py), starting with what they
        hold now: a disk tier a previous worker left is announced as this worker's."""
        with self._lock:
            self.events = events
            for tier, medium in ((self.memory, Medium.MEMORY), (self.disk, Medium.DISK)):
                if tier is not None:
                    events.stored(medium, [name[:-1] for name in tier.keys() if name[-1] == Part.MAIN])

    def _publish(self, names: Iterable[bytes]) -> None:
        """Publishes where the main parts among `names` are now (under the lock, after a change)."""
        if self.events is None:
            return
        for name in names:
            if name[-1] != Part.MAIN:
                continue
            for tier, medium in ((self.memory, Medium.MEMORY), (self.disk, Medium.DISK)):
                if tier is not None:
                    self.events.set_held(medium, name[:-1], name in tier)

    def put(self, key: bytes, payload: bytes | memoryview, part: Part = Part.MAIN) -> None:
        """Stores one block's payload (its KV bytes in the layout's shape) under `key`: in memory,
        and on disk too (written through, so that the disk holds every block a worker computed when
        it stops or crashes, not only what memory had evicted)."""
        self._put_record(key, encode(self.layout, key, payload, part), part)

    def put_record(self, key: bytes, record: bytes, part: Part = Part.MAIN) -> bool:
        """Stores a record another worker sent (FetchKV), as `put` stores a payload, if it is block
        `key`'s `part` under this store's layout and intact (record.py's checks); False, nothing
        stored, otherwise."""
        checked = decode(self.layout, key, record, part)
        if isinstance(checked, Miss):
            self.counters.rejected[checked.reason] += 1
            return False
        self._put_record(key, bytes(record), part)
        return True

    def record_of(self, key: bytes, part: Part = Part.MAIN) -> bytes | None:
        """Block `key`'s record as a tier holds it (memory first, then disk), unchecked: what FetchKV
        sends, the receiver checking it (`put_record`). None where no tier holds it."""
        name = record_name(key, part)
        with self._lock:
            if self.memory is not None:
                record = self.memory.get(name)
                if record is not None:
                    return record
            if self.disk is None or name not in self.disk:
                return None
            path = self.disk.path_of(name)
        try:
            return path.read_bytes()
        except OSError:
            return None

    def record_bytes(self, part: Part = Part.MAIN) -> int:
        """One record's size: what a tier's capacity is counted in."""
        return HEADER.size + self.layout.block_bytes(window=part is Part.WINDOW)

    def _put_record(self, key: bytes, record: bytes, part: Part) -> None:
        name = record_name(key, part)
        with self._lock:
            spilled = [(name, record)]
            touched = [name]
            if self.memory is not None:
                self.counters.stored[self.memory.name] += 1
                spilled = self.memory.put(name, record)
                self.counters.evicted[self.memory.name] += sum(n != name for n, _ in spilled)
                touched += (n for n, _ in spilled)
                spilled.append((name, record))
            if self.disk is not None:
                for spilled_name, spilled_record in spilled:
                    if spilled_name not in self.disk:
                        self.counters.stored[self.disk.name] += 1
                        dropped = self.disk.put(spilled_name, spilled_record)
                        self.counters.evicted[self.disk.name] += len(dropped)
                        touched += dropped
            self._publish(touched)

    def _spill(self, evicted: list[tuple[bytes, bytes]], promoted: bytes) -> None:
        """What memory evicted to take in `promoted`, written to disk where the disk lacks it (it has
        what was written through, unless its own eviction dropped it). Under the lock."""
        self.counters.evicted[self.memory.name] += sum(name != promoted for name, _ in evicted)
        touched = [promoted, *(name for name, _ in evicted)]
        for name, record in evicted:
            if name != promoted and name not in self.disk:
                self.counters.stored[self.disk.name] += 1
                dropped = self.disk.put(name, record)
                self.counters.evicted[self.disk.name] += len(dropped)
                touched += dropped
        self._publish(touched)

    def where(self, key: bytes, part: Part = Part.MAIN) -> str | None:
        """The tier that holds the block (unchecked: a later `get` may still reject it), or None."""
        name = record_name(key, part)
        with self._lock:
            for tier in (self.memory, self.disk):
                if tier is not None and name in tier:
                    return tier.name
        return None

    def prefetch(self, keys: Sequence[bytes], part: Part = Part.MAIN) -> int:
        """Reads the disk-held records among `keys` (in a row from the first: a prefix is used only
        up to its first gap) into memory, checking each; returns how many it brought. Meant for a
        thread of its own: the file reads and the checks run outside the lock, so the engine's own
        calls never wait on the disk. Without a memory tier the records wait in a staging area that
        the next `get` of each takes them from."""
        brought = 0
        for key in keys:
            name = record_name(key, part)
            with self._lock:
                if (self.memory is not None and name in self.memory) or name in self._staged:
                    continue
                if self.disk is None or name not in self.disk:
                    break
                path = self.disk.path_of(name)
            try:
                record = path.read_bytes()
            except OSError:
                break
            payload = decode(self.layout, key, record, part)
            with self._lock:
                if isinstance(payload, Miss):
                    self.disk.remove(name)
                    self.counters.rejected[payload.reason] += 1
                    self._publish([name])
                    break
                self.disk.touch(name)
                self.counters.prefetched += 1
                if self.memory is None:
                    self._staged[name] = record
                    self._staged_bytes += len(record)
                    while self._staged_bytes > STAGED_BYTES:
                        self._staged_bytes -= len(self._staged.popitem(last=False)[1])
                else:
                    self._spill(self.memory.put(name, record), name)
            brought += 1
        return brought

    def get(self, key: bytes, part: Part = Part.MAIN) -> bytearray | None:
        """The block's payload, checked, or None (a miss)."""
        name = record_name(key, part)
        started = time.perf_counter()
        with self._lock:
            staged = self._staged.pop(name, None)
            if staged is not None:
                self._staged_bytes -= len(staged)
                payload = decode(self.layout, key, staged, part)
                if not isinstance(payload, Miss):
                    self.counters.hits["prefetched"] += 1
                    self.counters.read_seconds["prefetched"] += time.perf_counter() - started
                    return payload
            for tier in (self.memory, self.disk):
                if tier is None:
                    continue
                record = tier.get(name)
                if record is None:
                    continue
                payload = decode(self.layout, key, record, part)
                if isinstance(payload, Miss):
                    tier.remove(name)
                    self.counters.rejected[payload.reason] += 1
                    self._publish([name])
                    continue
                self.counters.hits[tier.name] += 1
                if tier is self.disk and self.memory is not None:
                    self._spill(self.memory.put(name, record), name)
                self.counters.read_seconds[tier.name] += time.perf_counter() - started
                return payload
            self.counters.misses += 1
            self._publish([name])  # a file that vanished or could not be read is gone from the disk tier
            return None

    def stats(self) -> dict[str, float]:
        """Flat figures for the worker's stats: records and bytes per tier, hits, misses, rejects."""
        out: dict[str, float] = {"kv_tier_misses_total": float(self.counters.misses)}
        with self._lock:
            for tier in (self.memory, self.disk):
                if tier is None:
                    continue
                out[f"kv_tier_blocks:{tier.name}"] = float(len(tier))
                out[f"kv_tier_bytes:{tier.name}"] = float(tier.used)
                out[f"kv_tier_hits_total:{tier.name}"] = float(self.counters.hits[tier.name])
                out[f"kv_tier_stored_total:{tier.name}"] = float(self.counters.stored[tier.name])
                out[f"kv_tier_evicted_total:{tier.name}"] = float(self.counters.evicted[tier.name])
            out["kv_tier_rejected_total"] = float(sum(self.counters.rejected.values()))
            out["kv_tier_prefetched_total"] = float(self.counters.prefetched)
            out["kv_tier_hits_total:prefetched"] = float(self.counters.hits["prefetched"])
            for tier_name in [t.name for t in (self.memory, self.disk) if t is not None] + ["prefetched"]:
                out[f"kv_tier_read_seconds_total:{tier_name}"] = self.counters.read_seconds[tier_name]
        return out
