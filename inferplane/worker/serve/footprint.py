"""The worker's memory against its limit: checked before loading, the KV pool fitted, freed memory
handed back.

`plan` estimates the footprint (api/footprint.py) from the model's config and the settled engine
options, reads the memory limit the worker runs under (the smallest of its cgroup's limit, v1 or v2,
and INFERPLANE_MEMORY_LIMIT, which the operator sets to the container's `limits.memory` through the
Downward API) and decides:
- the model does not fit even with the smallest KV pool (loading and converting it peaks over the
  limit, or its weights and one full-context sequence's KV are over it): the worker refuses to
  start, with the estimate's parts and the memory to ask for, rather than being OOM-killed over
  and over;
- the KV pool does not fit beside the rest: it is shrunk to what fits (a warning says so), down to
  one full-context sequence, below which the worker refuses;
- no limit is known (a laptop, local mode): nothing is checked.
INFERPLANE_MEMORY_CHECK=warn turns refusals into warnings (the estimate is deliberately high).

Freed memory: glibc keeps the heap a process freed (the float32 model after cpu-int8's conversion:
~300 MiB for SmolLM2, ~650 MiB for Gemma 3 270M) until asked to return it, and a cgroup counts it;
`release_freed_memory` asks (malloc_trim) after loading and after the conversion.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from inferplane.api.footprint import (
    Footprint,
    ModelSizes,
    estimate,
    kv_pool_bytes,
    mib,
    one_sequence_kv_bytes,
)
from inferplane.api.quantities import parse_bytes
from inferplane.worker.engine.kv.tiers.store import STAGED_BYTES

log = logging.getLogger(__name__)

LIMIT_ENV = "INFERPLANE_MEMORY_LIMIT"
CHECK_ENV = "INFERPLANE_MEMORY_CHECK"
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63
CGROUP_ROOT = Path("/sys/fs/cgroup")


class MemoryTooSmall(ValueError):
    """The model cannot be served within the worker's memory limit."""


@dataclass(frozen=True)
class MemoryPlan:
    footprint: Footprint  # with the KV pool the worker will allocate
    limit: int | None  # bytes; None: no limit known
    kv_cache_memory: int | None  # the KV pool's bytes when fitted below what was asked; None: as asked
    warning: str | None = None

    def figures(self) -> dict[str, float]:
        """For the worker's stats and metrics."""
        return {"memory_estimate_bytes": float(self.footprint.peak),
                "memory_estimate_served_bytes": float(self.footprint.served),
                "memory_estimate_needed_bytes": float(self.footprint.needed),
                "memory_limit_bytes": float(self.limit or 0)}


def memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                 environ: dict[str, str] | None = None) -> int | None:
    """The smallest memory limit this process runs under, in bytes; None if none is set."""
    environ = os.environ if environ is None else environ
    limits = []
    if environ.get(LIMIT_ENV):
        limits.append(parse_bytes(environ[LIMIT_ENV]))
    for path in _cgroup_limit_files(root, proc_cgroup):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text and text != "max" and text.isdigit() and int(text) < UNLIMITED:
            limits.append(int(text))
    return min(limits) if limits else None


def _cgroup_limit_files(root: Path, proc_cgroup: Path) -> list[Path]:
    """cgroup v2's memory.max and v1's memory.limit_in_bytes, at the hierarchy's root as a container
    sees it and at this process's own cgroup path (a host without cgroup namespaces)."""
    own: dict[str, str] = {}
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            own["v2" if controllers == "" else controllers] = path.lstrip("/")
    except (OSError, ValueError):
        pass
    files = [root / "memory.max", root / "memory" / "memory.limit_in_bytes",
             root / "unified" / "memory.max"]
    if "v2" in own:
        files += [root / own["v2"] / "memory.max", root / "unified" / own["v2"] / "memory.max"]
    memory = next((path for controllers, path in own.items() if "memory" in controllers.split(",")), None)
    if memory:
        files.append(root / "memory" / memory / "memory.limit_in_bytes")
    return files


def plan(config, options, *, model_path: str, device_type: str, max_model_len: int, limit: int | None,
         strict: bool | None = None) -> MemoryPlan | None:
    """The footprint of serving `config` with the settled `options` (worker/engine/options.py) under
    `limit`; MemoryTooSmall if it cannot fit. None where there is nothing to estimate (a GPU
    worker, whose weights and KV live in GPU memory; the embedding runtime)."""
    if device_type != "cpu" or options.runtime == "embedding":
        return None
    strict = os.environ.get(CHECK_ENV, "").lower() != "warn" if strict is None else strict
    sizes = ModelSizes.from_config(config, file_bytes=_file_bytes(model_path))
    kv_dtype_bytes = 2 if options.kv_cache_dtype in ("float16", "bfloat16") else 4
    if options.num_kv_blocks is not None:
        asked = int(options.num_kv_blocks) * options.block_size * sizes.kv_bytes_per_token * kv_dtype_bytes
    else:
        asked = int(parse_bytes(str(options.kv_cache_memory)))
    shape = dict(kv_dtype_bytes=kv_dtype_bytes, max_model_len=max_model_len, block_size=options.block_size)
    kv = kv_pool_bytes(sizes, kv_cache_memory=asked, max_num_seqs=options.max_num_seqs, **shape)

    tier_memory, tier_disk = options.offload_sizes()
    offload = tier_memory or (STAGED_BYTES if tier_disk else 0)  # the memory tier, or the disk's read-ahead

    def footprint(kv_bytes: int) -> Footprint:
        return estimate(sizes, int8=options.runtime == "cpu-int8", kv_cache=kv_bytes,
                        max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
                        quantize_head=options.quantize_head is not False, kv_offload=offload)

    full = footprint(kv)
    if limit is None or full.needed <= limit:
        return MemoryPlan(full, limit, None)
    least = one_sequence_kv_bytes(sizes, **shape)
    bare = footprint(0)
    room = min(limit - bare.needed_serving, kv)
    if full.needed_at_start <= limit and room >= least and options.num_kv_blocks is None:
        fitted = footprint(room)
        return MemoryPlan(fitted, limit, room, warning=(
            f"memory: the KV pool is {mib(room)}, not the {mib(kv)} asked for: that much does not fit the "
            f"{mib(limit)} memory limit beside the rest; the estimate {full.describe()}. Give "
            f"resources.memory {mib(full.needed)} for the whole pool"))
    if full.needed_at_start > limit:
        why = f"loading and converting the model needs {mib(full.needed_at_start)} before the KV pool exists"
    else:
        why = f"even a KV pool of one {max_model_len}-token sequence ({mib(least)}) needs " \
              f"{mib(bare.needed_serving + least)} while serving"
    message = (f"memory: the {mib(limit)} memory limit is too small for this model: {why}; the estimate "
               f"{full.describe()}. Raise resources.memory (the container's limit) to {mib(full.needed)} "
               f"(at least {mib(max(full.needed_at_start, bare.needed_serving + least))} with a smaller KV pool)")
    if strict:
        raise MemoryTooSmall(message)
    return MemoryPlan(full, limit, None, warning=message + f" (not refused: {CHECK_ENV}=warn)")


def _file_bytes(path: str) -> int:
    target = Path(path)
    if target.is_file():
        return target.stat().st_size
    if target.is_dir():
        return sum(f.stat().st_size for f in target.glob("*.safetensors"))
    return 0


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hands the heap memory the process freed back to the system (glibc's malloc_trim); a no-op
    elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def resident_bytes() -> tuple[int, int] | None:
    """(resident now, resident at its peak) of this process, from /proc; None where there is none."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
