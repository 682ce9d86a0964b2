"""Where one engine's decode steps spend their time: torch.profiler over a few steps of a full batch.

    python scripts/profile_engine.py --tinyllama --batch 256     # on a GPU: 1.1B random Llama, bf16
    python scripts/profile_engine.py --batch 16 --runtime cpu-int8  # on the CPU: SmolLM2
    python scripts/profile_engine.py --batch 16 --runtime cpu-int8 --prompt 1000 --kv-cache-dtype float16

Prints the per-step wall time and the operators that took the most self time (CPU and, on CUDA,
device time), so that a GPU lease's few minutes show what the engine is bound by.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack

import torch

from inferplane import LLM, SamplingParams
from inferplane.bench.engine import _prompts, _tinyllama_folder
from inferplane.bench.step_split import timed_attribute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tinyllama", action="store_true")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--runtime", default="paged")
    parser.add_argument("--float-head", action="store_true", help="cpu-int8: keep the output head float32")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype (auto: the compute dtype)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs (the 'before')")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.tinyllama:
        source, vocab = _tinyllama_folder(device, torch.bfloat16 if cuda else torch.float32), 32000
    else:
        source, vocab = "smollm2-135m", 49152
    extra = {"quantize_head": False} if args.float_head else {}
    extra["kv_cache_dtype"] = args.kv_cache_dtype
    if cuda:
        extra["enforce_eager"] = args.enforce_eager
    llm = LLM(source, runtime=args.runtime, device=str(device), **extra)
    prompts = _prompts(args.batch, args.prompt, vocab)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True), f"r{i}")
    while engine.stats().get("num_waiting", 0) or any(s.num_computed_tokens < s.num_tokens - 1
                                                        for s in engine.scheduler.running):
        engine.step()  # prefill everything first: the profile is of decode steps only
    for _ in range(3):
        engine.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    per_step = (time.perf_counter() - start) / args.steps
    print(f"{args.batch} sequences, {per_step * 1000:.2f} ms per decode step, "
          f"{args.batch / per_step:.0f} tokens/s")
    _print_split(engine, args.steps, sync)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _print_split(engine, steps: int, sync) -> None:
    """Where a step's wall time goes: scheduling, input preparation, the forward and sampling (which
    waits for the device: the sampled ids come back to the host), and the bookkeeping after."""
    spent = {name: [0.0] for name in ("schedule", "prepare", "execute")}
    runner = engine.runner
    with ExitStack() as stack:
        for owner, name in ((engine.scheduler, "schedule"), (runner, "prepare"), (runner, "execute")):
            stack.enter_context(timed_attribute(owner, name, spent[name]))
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
    total = (time.perf_counter() - start) / steps * 1000
    ms = {name: value[0] / steps * 1000 for name, value in spent.items()}
    print(f"step {total:.2f} ms = schedule {ms['schedule']:.2f} + prepare {ms['prepare']:.2f} + forward and "
          f"sampling {ms['execute'] - ms['prepare']:.2f} + after {total - ms['schedule'] - ms['execute']:.2f} "
          f"(graph replays so far: {engine.stats()['cuda_graph_steps']})")


if __name__ == "__main__":
    main()
