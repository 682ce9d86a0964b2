"""`inferplane bench cpu`: decode speed of cpu-int8 against our float32 engine and HF transformers'
float32 `generate`, at batch 1 and 16, plus the perplexity cost of int8, in one run.

Decode tokens/s is measured the same way for all three: generate 1 token and G tokens for the same
batch of prompts, and divide the B*(G-1) extra tokens by the extra time, so prefill cancels out.
The contenders take turns, one timing each per round, and each keeps its fastest: on a shared
machine whose speed drifts by 10-20% over minutes, measuring one contender after the other would
let the drift decide the ratios.
Every figure printed is measured in this run; the targets are the issue's, compared at the end.
"""

from __future__ import annotations

import argparse
import os
import time

TARGET_VS_HF = 3.0
TARGET_VS_OURS_AT_16 = 2.0
TARGET_PPL_RISE_PCT = 2.0


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferplane bench cpu", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated (default 1,16)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="G: tokens generated per sequence")
    p.add_argument("--repeats", type=int, default=3, help="rounds of timings; each contender keeps its fastest")
    p.add_argument("--threads", type=int, default=None, help="torch threads for every contender")
    p.add_argument("--kv-manager", default="paged", help="cpu-int8's KV manager (paged|radix)")
    p.add_argument("--head", choices=["float", "int8", "both"], default="both",
                   help="cpu-int8 output head: float (the runtime's default), int8 (quantize_head) or both")
    p.add_argument("--ppl-tokens", type=int, default=1024,
                   help="evaluation tokens for the perplexity rise (0: skip)")
    p.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    return p.parse_args(argv)


def _prompts(tokens: list[int], batch: int, length: int) -> list[list[int]]:
    """Distinct prompts (no shared prefix, so no contender gets a cache hit the others do not)."""
    return [tokens[(i * length) % (len(tokens) - length):][:length] for i in range(batch)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ours(llm, prompts):
    from inferplane.worker.sampling import SamplingParams

    def generate(n: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    return generate


def _hf(model, prompts):
    import torch

    ids = torch.tensor(prompts)

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    return generate


def decode_rates(generators: dict[str, object], batch: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Decode tokens/s per contender: batch * (G - 1) tokens over the fastest t(G) - t(1), with the
    contenders' timings interleaved round by round."""
    for generate in generators.values():
        generate(new_tokens)  # warm-up
    t_one = {name: float("inf") for name in generators}
    t_all = dict(t_one)
    for _ in range(repeats):
        for name, generate in generators.items():
            t_one[name] = min(t_one[name], _timed(lambda g=generate: g(1)))
            t_all[name] = min(t_all[name], _timed(lambda g=generate: g(new_tokens)))
    return {name: batch * (new_tokens - 1) / max(t_all[name] - t_one[name], 1e-9) for name in generators}


def _load_hf(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from inferplane.worker.kv.paged import blocks_for
    from inferplane.worker.llm import LLM
    from inferplane.worker.quant import gate

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    blocks = max(batches) * blocks_for(args.prompt_len + args.new_tokens, 16) + 8
    print(f"model {args.model}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens per sequence")

    start = time.perf_counter()
    dense = LLM(args.model, runtime="paged", device="cpu", num_kv_blocks=blocks)
    print(f"float32 engine loaded in {time.perf_counter() - start:.1f}s")
    variants: dict[str, object] = {}
    for head in (["float", "int8"] if args.head == "both" else [args.head]):
        name = "cpu-int8" if head == "float" else "cpu-int8, int8 head"
        start = time.perf_counter()
        variants[name] = LLM(args.model, runtime="cpu-int8", device="cpu", num_kv_blocks=blocks,
                             kv_manager=args.kv_manager, quantize_head=head == "int8")
        print(f"{name} loaded in {time.perf_counter() - start:.1f}s (conversion and start-up gate included)")
    hf = None
    if not args.skip_hf:
        start = time.perf_counter()
        hf = _load_hf(dense.engine.loaded.path)
        print(f"HF transformers loaded in {time.perf_counter() - start:.1f}s")

    tokens = gate.eval_tokens(dense.tokenizer)
    rates: dict[tuple[str, int], float] = {}
    for batch in batches:
        prompts = _prompts(tokens, batch, args.prompt_len)
        generators = {name: _ours(llm, prompts) for name, llm in variants.items()}
        generators["float32 engine"] = _ours(dense, prompts)
        if hf is not None:
            generators["HF float32 generate"] = _hf(hf, prompts)
        for name, rate in decode_rates(generators, batch, args.new_tokens, args.repeats).items():
            rates[(name, batch)] = rate

    print("\ndecode tokens/s")
    names = [*variants, "float32 engine"] + ([] if hf is None else ["HF float32 generate"])
    print(f"{'':22}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
    for name in names:
        print(f"{name:22}" + "".join(f"{rates[(name, b)]:12.1f}" for b in batches))

    print("\nratios (target)")
    ok = {name: True for name in variants}
    for name in variants:
        for b in batches:
            if hf is not None:
                r = rates[(name, b)] / rates[("HF float32 generate", b)]
                ok[name] &= r >= TARGET_VS_HF
                print(f"  {name:20} batch {b:>2}: / HF float32 = {r:5.2f}x (>= {TARGET_VS_HF:.0f}x: "
                      f"{'met' if r >= TARGET_VS_HF else 'MISSED'})")
            r = rates[(name, b)] / rates[("float32 engine", b)]
            verdict = ""
            if b == 16:
                ok[name] &= r >= TARGET_VS_OURS_AT_16
                met = "met" if r >= TARGET_VS_OURS_AT_16 else "MISSED"
                verdict = f" (>= {TARGET_VS_OURS_AT_16:.0f}x: {met})"
            print(f"  {name:20} batch {b:>2}: / our float32 = {r:5.2f}x{verdict}")

    for name, llm in variants.items():
        report = llm.weight_report
        mib = {k: v / 2**20 for k, v in report.items() if "bytes" in k and "ratio" not in k}
        print(f"\n{name}: int8 weights {mib['weight_bytes_int8']:.1f} MiB vs float32 "
              f"{mib['weight_bytes_float32']:.1f} MiB ({report['weight_bytes_ratio']:.3f}x); "
              f"whole model {mib['model_bytes_int8']:.1f} MiB vs {mib['model_bytes_float32']:.1f} MiB")
        if "gate_ppl_rise_pct" in report:
            print(f"  start-up gate ({int(report['gate_tokens'])} tokens): perplexity "
                  f"{report['gate_ppl_rise_pct']:+.2f}%, top-1 agreement {report['gate_top1_agreement']:.2%}")
        if args.ppl_tokens:
            result = gate.compare_models(dense.engine.loaded.model, llm.engine.loaded.model,
                                         tokens[: args.ppl_tokens])
            ok[name] &= result.ppl_rise_pct <= TARGET_PPL_RISE_PCT
            print(f"  evaluation text: {result.summary()}")
    complete = hf is not None and {1, 16} <= set(batches) and args.ppl_tokens > 0
    for name, met in ok.items():
        verdict = "NOT met" if not met else ("met" if complete else "met where measured (not all were)")
        print(f"\n{name}: all targets {verdict}", end="")
    print("\n(timings on a shared, busy 2-core machine are noisy)")
    return 0
