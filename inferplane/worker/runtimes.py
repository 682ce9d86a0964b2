"""Runtime presets: a runtime is a KV manager plus a weight format on the one engine.

Everything a runtime differs in is chosen here, so `LLM(runtime=...)`, `inferplane worker
--runtime` and the operator agree on what each name means.
"""

from __future__ import annotations

from inferplane.worker.kv.paged import PagedKV
from inferplane.worker.options import EngineOptions
from inferplane.worker.scheduler import Scheduler

RUNTIMES = ("paged",)


def check_runtime(name: str) -> None:
    if name not in RUNTIMES:
        raise ValueError(f"runtime: {name!r} is not available; choose one of {', '.join(RUNTIMES)}")


def build_kv_manager(options: EngineOptions, num_blocks: int):
    check_runtime(options.runtime)
    return PagedKV(num_blocks, options.block_size)


def build_scheduler(options: EngineOptions, kv) -> Scheduler:
    return Scheduler(kv, options.max_num_seqs, options.max_num_batched_tokens)
