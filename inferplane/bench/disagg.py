"""`inferplane bench disagg`: decode streams' inter-token latency while long prompts arrive, for one
pool of two replicas against a prefill replica plus a decode replica on the same cores.

Both layouts run the same two worker processes' worth of CPU (each worker one thread, OMP_NUM_THREADS=1,
so two workers share this machine's two cores alike) behind a gateway process, in one run:

- shared: two replicas, each taking short chat streams and long prompts as they come; a long
  prompt's prefill chunks share steps with the streams decoding there (chunks sized to the step
  target), so those streams' tokens wait;
- disaggregated: a prefill replica computes every long prompt (and its first token) and keeps its
  KV; the decode replica pulls the blocks and continues, and computes the short prompts itself
  (fewer uncached tokens than `--min-prefill-tokens`).

Load, the same in both: `--streams` clients each stream short completions (greedy and sampled in
turn: temperature 0.8, top_p 0.95) in a loop; one client sends long prompts of `--long-min` to
`--long-max` tokens (random words, never repeated, so no cache helps) with `--long-tokens` output
tokens, one after another. Printed per layout: the short streams' inter-token latency p50/p99 (the
gap between two text events as the client reads them: cpu-int8 streams its decode bursts as one
event, so a stall behind a prefill chunk shows as one long gap), the long prompts' time to first
token, and output tokens per second of all requests; then the ratios (goal: ITL p99 <= 0.5x the
shared pool's, throughput >= 0.8x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from inferplane.bench.gateway_harness import SERVED_MODEL, free_port, start_gateway, start_worker, wait_serving
from inferplane.bench.sampling_cases import SAMPLED

WORDS = ("river stone cloud garden lantern harbor meadow violin copper orchard signal thunder marble "
         "compass feather canyon velvet ember glacier summit hollow willow prism beacon").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="a built-in model name or a path")
    p.add_argument("--runtime", default="cpu-int8")
    p.add_argument("--seconds", type=float, default=60.0, help="load per layout")
    p.add_argument("--streams", type=int, default=4, help="clients streaming short completions")
    p.add_argument("--stream-tokens", type=int, default=64, help="output tokens of a short completion")
    p.add_argument("--long-min", type=int, default=2048, help="shortest long prompt, tokens")
    p.add_argument("--long-max", type=int, default=8192, help="longest long prompt, tokens")
    p.add_argument("--long-tokens", type=int, default=16, help="output tokens of a long-prompt request")
    p.add_argument("--min-prefill-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--kv-offload-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Load:
    gaps: list[float] = field(default_factory=list)  # short streams: seconds between text events
    long_ttft: list[float] = field(default_factory=list)
    tokens: int = 0  # output tokens of every request that finished
    errors: list[str] = field(default_factory=list)
    long_requests: int = 0
    short_requests: int = 0


async def _stream(client: httpx.AsyncClient, key: str, body: dict, load: Load, *, short: bool) -> None:
    started = time.monotonic()
    last: float | None = None
    tokens = 0
    body = {"model": SERVED_MODEL, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                load.errors.append(f"HTTP {response.status_code}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    load.errors.append(event["error"].get("code", "error"))
                    return
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if not any(c["text"] for c in event["choices"]):
                    continue
                now = time.monotonic()
                if last is None:
                    if not short:
                        load.long_ttft.append(now - started)
                elif short:
                    load.gaps.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        load.errors.append(type(exc).__name__)
        return
    load.tokens += tokens
    if short:
        load.short_requests += 1
    else:
        load.long_requests += 1


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(count))


async def _drive(base_url: str, key: str, args: argparse.Namespace, tokens_per_word: float) -> tuple[Load, float]:
    load = Load()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.seconds

    async def short_client(index: int) -> None:
        turn = 0
        while time.monotonic() < deadline:
            body = {"prompt": f"Story {index}-{turn}: " + _words(rng, 20), "max_tokens": args.stream_tokens,
                    **({"temperature": 0} if turn % 2 == 0 else SAMPLED)}
            await _stream(client, key, body, load, short=True)
            turn += 1

    async def long_client() -> None:
        while time.monotonic() < deadline:
            length = rng.randint(args.long_min, args.long_max)
            body = {"prompt": _words(rng, int(length / tokens_per_word)), "max_tokens": args.long_tokens,
                    "temperature": 0}
            await _stream(client, key, body, load, short=False)

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600)) as client:
        await asyncio.gather(long_client(), *(short_client(i) for i in range(args.streams)))
    return load, time.monotonic() - started


def _tokens_per_word(model: str) -> float:
    """How many tokens one of the bench's words takes, so long prompts hit their lengths."""
    from inferplane.worker.model.gguf_file import open_gguf
    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(open_gguf(model))
    sample = _words(random.Random(1), 500)
    return len(tokenizer.encode(sample)) / 500


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _layout(name: str, model: str, args: argparse.Namespace, home: str, tokens_per_word: float) -> dict:
    flags = ("--runtime", args.runtime, "--max-model-len", str(args.long_max + 512), "--kv-cache-memory",
             args.kv_cache_memory, "--kv-offload-memory", args.kv_offload_memory)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    workers = [start_worker(model, int(a.rsplit(":", 1)[1]), *flags, log_path=f"{home}/{name}-{i}.log")
               for i, a in enumerate(addresses)]
    gateway = None
    try:
        for address, worker in zip(addresses, workers, strict=True):
            wait_serving(address, worker, timeout=600)
        extra: tuple[str, ...] = ("--routing-policy", "least-loaded")
        decode = addresses
        if name == "disaggregated":
            decode = addresses[1:]
            extra += ("--prefill-worker", addresses[0], "--min-prefill-tokens", str(args.min_prefill_tokens))
        gateway = start_gateway(decode, log_path=f"{home}/{name}-gateway.log", extra=extra)
        load, seconds = await _drive(gateway.base_url, gateway.key, args, tokens_per_word)
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.kill()
            worker.wait()
    return {"layout": name, "itl_p50_s": _percentile(load.gaps, 0.5), "itl_p99_s": _percentile(load.gaps, 0.99),
            "long_ttft_p50_s": statistics.median(load.long_ttft) if load.long_ttft else float("nan"),
            "tokens_per_s": load.tokens / seconds, "short_requests": load.short_requests,
            "long_requests": load.long_requests, "errors": len(load.errors)}


def main(argv: list[str] | None = None) -> int:
    from inferplane.api.model_resolution import builtin_model_path

    parser = argparse.ArgumentParser(prog="inferplane bench disagg", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    model = str(builtin_model_path(args.model)) if not os.path.exists(args.model) else args.model
    os.environ["OMP_NUM_THREADS"] = "1"  # each worker one core: two workers, this machine's two cores
    tokens_per_word = _tokens_per_word(model)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as home:
        for name in ("shared", "disaggregated"):
            result = asyncio.run(_layout(name, model, args, home, tokens_per_word))
            results.append(result)
            print(f"{name:>14}: ITL p50 {result['itl_p50_s'] * 1000:7.1f} ms  p99 {result['itl_p99_s'] * 1000:7.1f} ms"
                  f"  long-prompt TTFT p50 {result['long_ttft_p50_s']:6.2f} s  {result['tokens_per_s']:6.1f} tokens/s"
                  f"  ({result['short_requests']} short, {result['long_requests']} long, {result['errors']} errors)",
                  flush=True)
    shared, split = results
    itl = split["itl_p99_s"] / shared["itl_p99_s"]
    throughput = split["tokens_per_s"] / shared["tokens_per_s"]
    print(f"disaggregated / shared: ITL p99 {itl:.2f}x (goal <= 0.5x), throughput {throughput:.2f}x (goal >= 0.8x)")
    print(json.dumps({"results": results, "itl_p99_ratio": itl, "throughput_ratio": throughput}))
    return 0 if not any(r["errors"] for r in results) else 1
