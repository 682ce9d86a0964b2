"""The disk tier: one file per record in a directory, least recently used first out.

The directory outlives the process (in a cluster a volume of the pod, or a node's folder per
deployment: operator/kv_tier.py; under `inferplane up` a folder of its home, one per replica), so
a worker that starts where another left finds its blocks: at start the tier lists the files
already there, oldest access first, and serves them like its own. Where pods of one deployment
share a node's folder (a rollout's new pod beside the old one), each keeps its own size accounting
over what it listed and wrote, so the folder holds at most the tier's size per writer; a file one
of them evicts is a miss for the other, never a wrong read. Files are
written whole to a temporary name and renamed into place, so a reader never sees half a record
under a block's name; a record damaged anyway (a full disk, a crash mid-write on a filesystem
that reorders) fails its checksum when read and is a miss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

SUFFIX = ".kvb"
STALE_TEMPORARY_S = 600.0


class DiskTier:
    """Records by name (bytes) under `directory` within `capacity` bytes of files."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self.found = self._index_existing()
        self._evict()

    def path_of(self, name: bytes) -> Path:
        """Where record `name` is (or would be) kept: read it there without the tier's bookkeeping."""
        return self._path(name)

    def touch(self, name: bytes) -> None:
        """Marks a record read some other way (a prefetch) as the most recently used."""
        if name in self._sizes:
            self._sizes.move_to_end(name)

    def _path(self, name: bytes) -> Path:
        hex_name = name.hex()
        return self.directory / hex_name[:2] / f"{hex_name}{SUFFIX}"

    def _index_existing(self) -> int:
        """Lists the records a previous process left, least recently used first; leftovers of an
        interrupted write (temporary names older than a write takes: another writer's may be in
        progress) are removed."""
        found = []
        stale = time.time() - STALE_TEMPORARY_S
        for path in self.directory.glob("*/*"):
            if not path.name.endswith(SUFFIX):
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < stale:
                        path.unlink(missing_ok=True)
                continue
            try:
                name = bytes.fromhex(path.name[:-len(SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime_ns, name, stat.st_size))
        for _, name, size in sorted(found):
            self._sizes[name] = size
            self.used += size
        return len(found)

    def __contains__(self, name: bytes) -> bool:
        return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, name: bytes, record: bytes) -> list[bytes]:
        """Writes `record` as the most recently used; returns the names it evicted (`name` itself
        when the record alone is larger than the tier, or the write failed)."""
        if len(record) > self.capacity:
            return [name]
        path = self._path(name)
        temporary = None
        try:
            path.parent.mkdir(exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
            with os.fdopen(descriptor, "wb") as file:
                file.write(record)
            os.replace(temporary, path)
        except OSError:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            self.remove(name)
            return [name]
        self.used -= self._sizes.pop(name, 0)
        self._sizes[name] = len(record)
        self.used += len(record)
        return self._evict()

    def get(self, name: bytes) -> bytes | None:
        """The file's bytes as they are (the caller checks them), or None if there is none."""
        if name not in self._sizes:
            return None
        path = self._path(name)
        try:
            record = path.read_bytes()
            os.utime(path)  # its recency survives a restart too
        except OSError:
            self.remove(name)
            return None
        self._sizes.move_to_end(name)
        return record

    def remove(self, name: bytes) -> bool:
        size = self._sizes.pop(name, None)
        self._path(name).unlink(missing_ok=True)
        if size is None:
            return False
        self.used -= size
        return True

    def keys(self) -> list[bytes]:
        """Every name held, least recently used first."""
        return list(self._sizes)

    def _evict(self) -> list[bytes]:
        evicted = []
        while self.used > self.capacity and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self.used -= size
            self._path(name).unlink(missing_ok=True)
            evicted.append(name)
        return evicted
