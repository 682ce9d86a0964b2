"""`inferplane bench lora`: many LoRA adapters in one batch against the base alone and against the
same fine-tunes served as merged models one after another, on one engine, in one run.

Three contenders serve the same requests (prompt length, new tokens, greedy) and take turns, one
timing each per round, each keeping its fastest (a shared machine's speed drifts over minutes):

- base:   every request on the base model (no adapter rows: the projections cost only the base);
- mixed:  request i runs under adapter i % N, all in one engine with N slots (one batch);
- merged: the N fine-tunes as merged models served one after another, each with its share of the
          requests as one batch (the weights are swapped in place between groups, so no load time
          is charged to this baseline: it is the kindest version of "a replica per fine-tune").

Printed: generated tokens/s of each and the ratios mixed/base (goal >= 0.75) and mixed/merged
(goal >= 4), and the time to first token of a request to an adapter that is on the node but in no
slot and not read yet, against one to the base (goal: <= 1 s added). Adapters are random PEFT-format
files written here (rank and targets as given), so no download is needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from inferplane.bench.sampling_cases import SAMPLED
from inferplane.worker.lora.adapter import ATTENTION_MODULES, CONFIG_FILE, SERVED_MODULES, WEIGHTS_FILE, module_shape


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferplane bench lora", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="base model (default: the built-in SmolLM2-135M)")
    p.add_argument("--runtime", default="paged", choices=("paged", "radix"),
                   help="runtime (float weights: the merged baseline swaps them in place)")
    p.add_argument("--adapters", type=int, default=8, help="adapters in the mixed batch (default 8)")
    p.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--targets", default=",".join(ATTENTION_MODULES),
                   help=f"comma-separated target modules (default q,k,v,o; any of {', '.join(SERVED_MODULES)})")
    p.add_argument("--requests", type=int, default=32, help="requests per contender (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timings per contender; each keeps its fastest")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args(argv)


def write_random_adapter(folder: Path, config, rank: int, targets: list[str], seed: int,
                         b_scale: float = 0.01) -> Path:
    """A PEFT-format adapter over `config`'s layers with random A and B (B's entries of size
    `b_scale`; scale lora_alpha / r = 2)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            if module not in ATTENTION_MODULES and config.is_moe_layer(layer):
                continue
            in_features, out_features = module_shape(config, module)
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * b_scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                  "target_modules": targets, "bias": "none"}))
    return folder


def _swap_weights(model, adapter, sign: float) -> None:
    """Adds (sign 1) or removes (sign -1) an adapter's merged delta in the float model's projections."""
    import torch

    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            owner = model.model.layers[layer]
            linear = getattr(owner.self_attn if module in ATTENTION_MODULES else owner.mlp, module)
            linear.weight.add_((b @ a).to(linear.weight.dtype), alpha=sign)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import torch

    from inferplane import LLM, SamplingParams
    from inferplane.worker.lora import LoraRequest, load_adapter

    if args.threads:
        torch.set_num_threads(args.threads)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(SERVED_MODULES))
    if unknown:
        raise SystemExit(f"--targets: {', '.join(unknown)} not served (choose from {', '.join(SERVED_MODULES)})")
    common = dict(runtime=args.runtime, device="cpu", dtype="float32", max_num_seqs=max(args.requests, 1))
    mixed_llm = LLM(args.model, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    merged_llm = LLM(args.model, **common)
    config = mixed_llm.engine.loaded.config
    workdir = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    folders = [write_random_adapter(workdir / f"adapter{i}", config, args.rank, targets, seed=i)
               for i in range(args.adapters + 1)]  # the last one is the unloaded adapter of the TTFT probe
    requests = [LoraRequest(f"adapter{i}", str(folders[i])) for i in range(args.adapters)]
    adapters = [load_adapter(r, config, args.rank) for r in requests]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=0, **SAMPLED)
    tokens = args.requests * args.new_tokens
    rows = [requests[i % args.adapters] for i in range(args.requests)]
    mixed_llm.generate(prompts[:2], params, lora_request=rows[:2])  # warm-up: slots loaded, kernels measured

    def base() -> None:
        mixed_llm.generate(prompts, params)

    def mixed() -> None:
        mixed_llm.generate(prompts, params, lora_request=rows)

    def mixed_sampled() -> None:
        mixed_llm.generate(prompts, sampled, lora_request=rows)

    def merged() -> None:
        model = merged_llm.engine.loaded.model
        for k, adapter in enumerate(adapters):
            group = prompts[k::args.adapters]
            if not group:
                continue
            _swap_weights(model, adapter, 1.0)
            try:
                merged_llm.generate(group, params)
            finally:
                _swap_weights(model, adapter, -1.0)

    contenders = {"base": base, "mixed": mixed, "mixed sampled": mixed_sampled, "merged": merged}
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            started = time.perf_counter()
            run()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
    rates = {name: tokens / seconds for name, seconds in best.items()}

    # One-token requests: a call's time is its TTFT. LLM reads the adapter before submitting (the
    # worker does it on a thread, off the engine), so the cold call pays read, slot load and prefill.
    probe = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    mixed_llm.generate(prompts[:1], probe)
    base_ttft = time.perf_counter() - started
    started = time.perf_counter()
    mixed_llm.generate(prompts[:1], probe, lora_request=LoraRequest("cold", str(folders[-1])))
    added = time.perf_counter() - started - base_ttft

    print(f"bench lora: {args.model}, runtime {args.runtime}, {args.adapters} adapters of rank {args.rank} on "
          f"{','.join(targets)}; {args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} new), "
          f"best of {args.rounds}; torch threads {torch.get_num_threads()}")
    for name in contenders:
        print(f"  {name:13s} {rates[name]:8.1f} tokens/s  ({best[name]:.2f} s)")
    print(f"  mixed / base   = {rates['mixed'] / rates['base']:.2f}x  (goal >= 0.75)")
    print(f"  mixed / merged = {rates['mixed'] / rates['merged']:.2f}x  (goal >= 4)")
    print(f"  mixed sampled (temperature 0.8, top_p 0.95) / mixed = {rates['mixed sampled'] / rates['mixed']:.2f}x")
    print(f"  first request to an unloaded adapter: +{added * 1000:.0f} ms over the base's "
          f"{base_ttft * 1000:.0f} ms TTFT (goal <= 1000 ms)")
    stats = mixed_llm.stats()
    print(f"  slots: loads {stats['lora_loads_total']:.0f}, evictions {stats['lora_evictions_total']:.0f}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
