"""The machine's memory read bandwidth: the physical bound on batch-1 decode.

A batch-1 decode step reads every weight once, so tokens/s can be at most bandwidth / weight
bytes per token. This measures the read bandwidth the way a decode step reads: `threads` threads
each summing their share of a buffer several times larger than the last-level cache (so it comes
from DRAM, not cache), fastest of a few rounds.
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


def read_bandwidth(threads: int = 2, rounds: int = 5) -> tuple[float, int]:
    """(bytes/s, buffer bytes): the fastest of `rounds` full reads of a buffer at least 4x the LLC."""
    import torch

    llc = last_level_cache_bytes() or 0
    size = max(_MIN_BUFFER, 4 * llc)
    buffer = torch.ones(size // 4, dtype=torch.float32)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer.sum()  # pages touched before timing
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return size / best, size


def describe(bandwidth: float, size: int, threads: int) -> str:
    llc = last_level_cache_bytes()
    where = f", last-level cache {llc / 2**20:.0f} MiB" if llc else ""
    return (f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s ({threads} threads summing "
            f"{size / 2**20:.0f} MiB{where}; {os.cpu_count()} CPUs)")
