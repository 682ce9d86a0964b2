"""The machine's memory read bandwidth: the physical bound on batch-1 decode.

A batch-1 decode step reads every weight once, so tokens/s can be at most bandwidth / weight
bytes per token. This measures the read bandwidth the way a decode step reads: `threads` threads
each summing their share of a buffer several times larger than the last-level cache (so it comes
from DRAM, not cache), fastest of a few reads. The buffer is memory of the kind the weights stream
from: a weight arena, advised for 2 MiB pages (quant/weight_arena.py). On 4 KiB pages the same read
was 5-48% slower on this project's EPYC (44 against 65 GB/s at one moment), which understated the
bound and flattered the fraction of it a decode reached.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_MIN_BUFFER = 512 * 2**20


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache this Linux machine reports (sysfs), or None where it says nothing."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, KeyError):
            continue
    return max(sizes) if sizes else None


class ReadBandwidth:
    """Timed full reads of a buffer at least 4x the LLC by `threads` threads, the fastest kept.

    Why reads one at a time: on a shared machine the bandwidth a decode sees drifts (28 to 65 GB/s
    over minutes on this project's machine), so bench cpu takes a few reads in each round of its
    batch-1 decode timings, and the bound is measured over the same minutes as the decode it bounds."""

    def __init__(self, threads: int = 2):
        import torch

        from inferplane.worker.quant.weight_arena import WeightArena

        self.threads = threads
        self.size = max(_MIN_BUFFER, 4 * (last_level_cache_bytes() or 0))
        self._arena = WeightArena(self.size)  # the mapping the buffer's bytes live in: kept while it is read
        self._buffer = self._arena.bytes.view(torch.float32)
        self._buffer.fill_(1.0)  # pages touched (and backed) before timing
        self.huge_page_bytes = self._arena.huge_page_bytes()
        self.best_seconds = float("inf")
        self.worst_seconds = 0.0  # the slowest read: with the fastest, how far the bandwidth drifted
        self.reads = 0
        self._timed_read()  # a first read, untimed: caches and TLB as a steady read finds them

    def _timed_read(self) -> float:
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            start = time.perf_counter()
            self._buffer.sum()
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(previous)

    def measure(self, reads: int = 1) -> None:
        """`reads` timed reads; the fastest so far is the bandwidth."""
        for _ in range(reads):
            self.read()

    def read(self) -> float:
        """One timed read, counted with the others: its bytes/s."""
        seconds = self._timed_read()
        self.best_seconds = min(self.best_seconds, seconds)
        self.worst_seconds = max(self.worst_seconds, seconds)
        self.reads += 1
        return self.size / seconds

    @property
    def bytes_per_second(self) -> float:
        return self.size / self.best_seconds

    @property
    def slowest_bytes_per_second(self) -> float:
        """The slowest read's rate. Why print it: on a shared machine the bandwidth switches between
        levels (about 32 and 50 GB/s on this project's) for seconds at a time, and batch-1 decode's
        fixed costs do not shrink with it, so its fraction of the bound is higher in the slow level."""
        return self.size / self.worst_seconds if self.worst_seconds > 0 else float("nan")


def read_bandwidth(threads: int = 2, rounds: int = 5) -> tuple[float, int]:
    """(bytes/s, buffer bytes): the fastest of `rounds` full reads taken back to back."""
    reader = ReadBandwidth(threads)
    for _ in range(rounds):
        reader.measure()
    return reader.bytes_per_second, reader.size


def describe(bandwidth: float, size: int, threads: int, reads: str = "", huge_page_bytes: int | None = None) -> str:
    llc = last_level_cache_bytes()
    where = f", last-level cache {llc / 2**20:.0f} MiB" if llc else ""
    pages = "" if huge_page_bytes is None else f", {huge_page_bytes / 2**20:.0f} MiB of it on 2 MiB pages"
    return (f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s ({threads} threads summing "
            f"{size / 2**20:.0f} MiB{pages}{where}; {os.cpu_count()} CPUs{reads})")
