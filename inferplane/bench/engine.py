"""`inferplane bench engine`: our paged runtime against HF transformers, same prompts, one process.

Peers: HF `generate_batch` (continuous batching, attn_implementation "paged|sdpa") and HF
`generate` (static batches). Each generates exactly `--new` tokens per request (EOS ignored), and
tokens/s counts generated tokens over wall time, so the figures compare like with like.

CPU default: SmolLM2-135M (fp32) from its GGUF, 64 requests of 128 prompt + 128 new tokens.
`--tinyllama`: a random-weight Llama of TinyLlama's shape (1.1B, bf16 on CUDA), 256 x (128 + 256),
with the fraction of the memory-bandwidth bound our engine reached. On CUDA the same engine also runs
batches of 1 and 16 (`--batches`), each with its fraction of the bound, and, with `--compare-eager`,
the full batch again without CUDA graphs (enforce_eager), the before and after of the graphs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from inferplane.bench.sampling_cases import CASES


def _prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=gen).tolist() for _ in range(count)]


def _tinyllama_folder(device: torch.device, dtype: torch.dtype) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = os.path.join(tempfile.gettempdir(), f"inferplane-tinyllama-random-{str(dtype).split('.')[-1]}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                             rope_theta=10000.0, tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        model.save_pretrained(folder)
        del model
    return folder


def _hf_model(source: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if source.endswith(".gguf"):
        folder, name = os.path.split(source)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    return model.to(device).eval()


def run_ours(model: str, prompts, new_tokens: int, device: str, dtype: str, **options) -> dict:
    from inferplane import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, **options)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    return measure_ours(llm, prompts, new_tokens)


def measure_ours(llm, prompts, new_tokens: int, case: str = "greedy") -> dict:
    """One timed generate of `prompts` on an engine already warmed up; `case`: greedy or sampled
    (bench/sampling_cases.py, seeded)."""
    from inferplane import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=0, **CASES[case])
    steps = 0
    original_step = llm.engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return original_step()

    llm.engine.step = counted_step
    _sync(llm.engine.device)
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
        _sync(llm.engine.device)
    finally:
        del llm.engine.step
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {"elapsed": elapsed, "generated": generated, "steps": steps, "llm": llm, "outputs": outs}


def run_hf_generate_batch(model, prompts, new_tokens: int) -> dict:
    from transformers import GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config)
    _sync(model.device)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    model.set_attn_implementation("sdpa")
    return {"elapsed": elapsed, "generated": generated}


def run_hf_generate(model, prompts, new_tokens: int, batch_size: int) -> dict:
    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            ids = torch.tensor(chunk, device=model.device)  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    _sync(model.device)
    return {"elapsed": time.perf_counter() - start, "generated": generated}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measured_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) // 4 if device.type == "cuda" else (1 << 27) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - start)


def bandwidth_fraction(ours: dict, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    """Bytes the run had to read at least (all weights once per step, each token's KV context once per
    generated token) over measured bandwidth, divided by the time it took."""
    llm = ours["llm"]
    config = llm.engine.loaded.config
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.loaded.model.parameters())
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * llm.engine.cache.data.element_size()
    requests = len(ours["outputs"])
    kv_bytes = requests * sum(prompt_len + i for i in range(new_tokens)) * kv_per_token
    ideal = (ours["steps"] * weight_bytes + kv_bytes) / bandwidth
    return ideal / ours["elapsed"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferplane bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--tinyllama", action="store_true", help="random TinyLlama-shaped model (for a GPU)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=None, help="new tokens per request")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="batch size of the HF generate peer")
    parser.add_argument("--skip", nargs="*", default=[], choices=["generate_batch", "generate"],
                        help="peers to leave out")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16],
                        help="CUDA: smaller batches the same engine also runs, each with its fraction of the bound")
    parser.add_argument("--compare-eager", action="store_true",
                        help="CUDA: run the full batch again without CUDA graphs (enforce_eager)")
    parser.add_argument("--structured", action="store_true",
                        help="instead: JSON-schema constrained against free generation, batch 1 and 64")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.structured:
        from inferplane.bench.structured import run
        from inferplane.worker.model.loader import resolve_model_path

        run(resolve_model_path("smollm2-135m"), device="cpu" if args.device == "auto" else args.device,
            new_tokens=args.new or 96)
        return 0

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.tinyllama:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        source = _tinyllama_folder(device, dtype)
        requests, new, vocab = args.requests or 256, args.new or 256, 32000
    else:
        from inferplane.worker.model.loader import resolve_model_path

        dtype = torch.float32
        source = resolve_model_path("smollm2-135m")
        requests, new, vocab = args.requests or 64, args.new or 128, 49152
    dtype_name = str(dtype).split(".")[-1]
    prompts = _prompts(requests, args.prompt, vocab)
    batched = args.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)
    print(f"model={os.path.basename(source)} device={device} dtype={dtype_name} requests={requests} "
          f"prompt={args.prompt} new={new} threads={torch.get_num_threads()}", flush=True)

    results: dict[str, dict] = {}
    cuda = device.type == "cuda"
    ours = run_ours(source, prompts, new, str(device), dtype_name, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=batched)
    results["inferplane paged"] = ours
    label = "inferplane paged" + (" (graphs)" if cuda else "")
    stats = ours["llm"].stats()
    print(f"{label:<24}{ours['generated'] / ours['elapsed']:10.1f} tokens/s "
          f"({ours['elapsed']:.1f} s, {ours['steps']} steps, preemptions={stats['preemptions']}"
          + (f", graphs' pool {stats['cuda_graph_reserve_bytes'] / 2**20:.0f} MiB" if cuda else "") + ")", flush=True)
    sampled = measure_ours(ours["llm"], prompts, new, "sampled")
    sampled_rate = sampled["generated"] / sampled["elapsed"]
    print(f"{label + ' sampled':<24}{sampled_rate:10.1f} tokens/s ({sampled['elapsed']:.1f} s; temperature 0.8, "
          f"top_p 0.95): {sampled_rate / (ours['generated'] / ours['elapsed']):.2f}x greedy", flush=True)
    del sampled
    bandwidth = measured_bandwidth(device)
    fraction = bandwidth_fraction(ours, args.prompt, new, bandwidth)
    fractions = {requests: fraction}
    if cuda:
        for batch in sorted(b for b in args.batches if 0 < b < requests):
            small = measure_ours(ours["llm"], prompts[:batch], new)
            fractions[batch] = bandwidth_fraction(small, args.prompt, new, bandwidth)
            print(f"  batch {batch:<4} {small['generated'] / small['elapsed']:10.1f} tokens/s "
                  f"({small['elapsed'] / small['steps'] * 1000:.2f} ms a step), "
                  f"{fractions[batch] * 100:.1f}% of the bound", flush=True)
    del ours["llm"], ours["outputs"]  # the engine's KV pool goes before the next engine takes its own
    if cuda and args.compare_eager:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        eager = run_ours(source, prompts, new, str(device), dtype_name, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=batched, enforce_eager=True)
        eager_fraction = bandwidth_fraction(eager, args.prompt, new, bandwidth)
        del eager["llm"], eager["outputs"]
        results["inferplane paged (eager)"] = eager
        print(f"inferplane paged (eager){eager['generated'] / eager['elapsed']:10.1f} tokens/s "
              f"({eager['elapsed']:.1f} s, {eager_fraction * 100:.1f}% of the bound)", flush=True)
        gc.collect()
        torch.cuda.empty_cache()

    if {"generate_batch", "generate"} - set(args.skip):
        hf = _hf_model(source, device, dtype)
        if "generate_batch" not in args.skip:
            results["HF generate_batch"] = run_hf_generate_batch(hf, prompts, new)
            r = results["HF generate_batch"]
            print(f"HF generate_batch       {r['generated'] / r['elapsed']:10.1f} tokens/s ({r['elapsed']:.1f} s)",
                  flush=True)
        if "generate" not in args.skip:
            results["HF generate"] = run_hf_generate(hf, prompts, new, args.hf_batch_size)
            r = results["HF generate"]
            print(f"HF generate (batch {args.hf_batch_size:<3}) {r['generated'] / r['elapsed']:10.1f} tokens/s "
                  f"({r['elapsed']:.1f} s)", flush=True)

    ours_tps = ours["generated"] / ours["elapsed"]
    print()
    for name, r in results.items():
        if name != "inferplane paged":
            print(f"ratio {label.strip()} / {name}: {ours_tps / (r['generated'] / r['elapsed']):.2f}x")
    print(f"memory bandwidth measured: {bandwidth / 1e9:.1f} GB/s; inferplane reached "
          f"{fraction * 100:.1f}% of the bandwidth bound (weights + KV read per step)")
    if len(fractions) > 1:
        shares = ", ".join(f"{b}: {f * 100:.1f}%" for b, f in sorted(fractions.items()))
        print(f"fraction of the bound by batch: {shares}")
    return 0
