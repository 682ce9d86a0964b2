"""The host-memory tier: records kept in this process, least recently used first out.

The first tier a block leaves the pool to. On the CPU runtimes the pool is host memory too; what the
tier adds there is room the pool's budget does not have to hold, and the way to the disk tier: what
it evicts is handed back to its caller (the store), which spills it to disk.
"""

from __future__ import annotations

from collections import OrderedDict


class MemoryTier:
    """Records by key within `capacity` bytes (a record larger than that is not kept)."""

    name = "memory"

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._records: OrderedDict[bytes, bytes] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def put(self, key: bytes, record: bytes) -> list[tuple[bytes, bytes]]:
        """Keeps `record` as the most recently used; returns what it evicted to make room (oldest
        first), `record` itself when it alone is larger than the tier."""
        if len(record) > self.capacity:
            return [(key, record)]
        self.remove(key)
        self._records[key] = record
        self.used += len(record)
        evicted = []
        while self.used > self.capacity:
            old_key, old = self._records.popitem(last=False)
            self.used -= len(old)
            evicted.append((old_key, old))
        return evicted

    def get(self, key: bytes) -> bytes | None:
        record = self._records.get(key)
        if record is not None:
            self._records.move_to_end(key)
        return record

    def remove(self, key: bytes) -> bool:
        record = self._records.pop(key, None)
        if record is None:
            return False
        self.used -= len(record)
        return True

    def keys(self) -> list[bytes]:
        """Every key held, least recently used first."""
        return list(self._records)
