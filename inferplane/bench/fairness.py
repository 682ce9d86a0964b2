"""Two tenants on one replica: does a flooding tenant raise an interactive tenant's latency?

One worker (the tiny model, the radix runtime, `--max-num-seqs` slots) behind one gateway, each in
its own process. The interactive tenant sends short streamed chats one at a time and records the
time to the first token (TTFT); a poller reads `/healthz` every 20 ms. First the interactive tenant
runs alone; then under each flood the issue named (issue 29), sent by a second tenant of the same
band:

- `grammar-choices`: three copies of a 100,000-entry `guided_choice` in a loop;
- `grammar-regex`: eight copies of `guided_regex: "(a{1000}){1000}"` in a loop;
- `fan-out`: `n` = every slot, `max_tokens` 900;
- `fan-out+logprobs`: the same with `logprobs`, `top_logprobs` 20;
- `big-bodies`: unauthenticated 200 MB chunked POSTs to the admin API;
- `backlog`: a steady backlog of long generations (twice as many as there are slots);
- `slow-heads` (issue 53, class 5): 64 connections, half dribbling a header a byte every 100 ms,
  half sending a 64 MiB header a MiB at a time, each reconnecting when the gateway closes it;
- `refused-prompts` (issue 53, class 6): a key limited to 5 requests a minute sends 1 MiB chat
  prompts, far over the context, 4 at once in a loop (400s, then 429s);
- `adapter-poison`, `adapter-patterns` (issue 53, classes 1 and 2; bench/fairness_adapters.py):
  the flooding tenant registers LoRA adapters with non-finite values, or with catastrophic
  `alpha_pattern` / `rank_pattern` regexes, in a loop through the admin API, and chats on its own
  adapter (and on any that got registered), while the interactive tenant alternates its own
  adapter and the base; its greedy answers are also held to its answers alone. With either case
  selected the worker has LoRA slots and the gateway a registry base and both tenants' adapters.

It prints, per case, the interactive TTFT p50/p99, p99 under the flood over p99 alone (goal <= 2),
and the `/healthz` p99 (goal <= 50 ms). Then the flooding tenant's throughput (completion tokens/s)
with its backlog alone against the same backlog while the interactive tenant is active (goal >= 90%),
and a `batch`-band tenant's backlog against a `critical` tenant's TTFT (goal p99 <= 2x alone).

Everything runs on this machine's CPUs; the figures are what they are here (the ratio is the
point: both sides of it are measured in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile

from inferplane.bench.fairness_adapters import ADAPTER_CASES, AdapterSetup, run_cases
from inferplane.bench.fairness_harness import (
    PROBE_MAX_TOKENS,
    Flood,
    Health,
    Tenants,
    measure,
    probe,
    row,
    throughput,
)

LIMITED = "limited"  # a tenant whose key may send 5 requests a minute (`refused-prompts`)


def flood_cases(slots: int) -> dict[str, Flood]:
    choices = [f"c{i}" for i in range(100_000)]
    return {
        "grammar-choices": Flood("flood", 3, {"guided_choice": choices, "max_tokens": 8}),
        "grammar-regex": Flood("flood", 8, {"guided_regex": "(a{1000}){1000}", "max_tokens": 8}),
        "fan-out": Flood("flood", 1, {"n": slots, "max_tokens": 900}),
        "fan-out+logprobs": Flood("flood", 1, {"n": slots, "max_tokens": 900, "logprobs": True, "top_logprobs": 20}),
        "big-bodies": Flood("flood", 2, body_mb=200),
        "backlog": Flood("flood", 2 * slots, {"max_tokens": 900}),
        "slow-heads": Flood("flood", 64, heads=True),
        "refused-prompts": Flood(LIMITED, 4, {"messages": [{"role": "user", "content": "word " * 200_000}],
                                              "max_tokens": 1}),
    }


def _adapter_cases(args: argparse.Namespace) -> list[str]:
    """The adapter cases selected: all by default, as the other floods."""
    return [n for n in args.cases or ADAPTER_CASES if n in ADAPTER_CASES]


async def run(args: argparse.Namespace, t: Tenants, adapters=None) -> dict:
    slots = args.max_num_seqs
    results: dict = {"cases": {}}
    await probe(t, "interactive", 3)  # warm-up: connections, the first request's one-time costs
    await probe(t, "critical", 3)
    alone, health = await measure(t, "interactive", args.samples, None, 0)
    print("interactive tenant: streamed chats one at a time, max_tokens "
          f"{PROBE_MAX_TOKENS}; TTFT from send to first content chunk", flush=True)
    print(row("alone", alone, health, alone.pct(0.99)), flush=True)
    results["alone"] = {"p50": alone.pct(0.5), "p99": alone.pct(0.99), "healthz_p99": health.pct(0.99)}
    cases = flood_cases(slots)
    for name in [n for n in args.cases or list(cases) if n not in ADAPTER_CASES]:
        p, h = await measure(t, "interactive", args.samples, cases[name], args.warmup)
        print(row(name, p, h, alone.pct(0.99)), flush=True)
        results["cases"][name] = {"p50": p.pct(0.5), "p99": p.pct(0.99), "healthz_p99": h.pct(0.99),
                                  "ratio": p.pct(0.99) / alone.pct(0.99), "errors": p.errors}
    if adapters is not None:

        await run_cases(args, t, adapters, _adapter_cases(args), results)
    copies = 2 * slots
    by_itself = await throughput(t, "flood", copies, args.throughput_seconds)
    with_probe = await throughput(t, "flood", copies, args.throughput_seconds,
                                  alongside=lambda: probe(t, "interactive", 1))
    share = with_probe / by_itself if by_itself else float("nan")
    print(f"\nflooding tenant's backlog ({copies} generations at once, max_tokens 100): "
          f"{by_itself:.0f} tokens/s alone, {with_probe:.0f} tokens/s beside the interactive tenant "
          f"({share:.0%}, goal >= 90%)", flush=True)
    results["throughput"] = {"alone": by_itself, "beside_interactive": with_probe, "share": share}
    critical_alone, _ = await measure(t, "critical", args.samples, None, 0)
    batch_flood = Flood("batch", copies, {"max_tokens": 900})
    critical, h = await measure(t, "critical", args.samples, batch_flood, args.warmup)
    print("\npriority: a critical tenant's chats beside a batch tenant's backlog", flush=True)
    print(row("critical alone", critical_alone, Health(), critical_alone.pct(0.99)), flush=True)
    print(row("critical + batch", critical, h, critical_alone.pct(0.99)), flush=True)
    results["priority"] = {"alone_p99": critical_alone.pct(0.99), "p99": critical.pct(0.99),
                           "ratio": critical.pct(0.99) / critical_alone.pct(0.99)}
    worst = max([c["ratio"] for c in results["cases"].values()] + [results["priority"]["ratio"]])
    worst_health = max([c["healthz_p99"] for c in results["cases"].values()] + [results["alone"]["healthz_p99"]])
    print(f"\nworst p99 ratio {worst:.2f} (goal <= 2); worst /healthz p99 {worst_health:.1f} ms (goal <= 50); "
          f"median of the per-case p50s {statistics.median(c['p50'] for c in results['cases'].values()):.1f} ms",
          flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferplane bench fairness", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="where the tiny model is kept (created if missing)")
    parser.add_argument("--runtime", default="radix", choices=["paged", "radix"])
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--samples", type=int, default=40, help="interactive chats per case")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds a flood runs before the probe starts")
    parser.add_argument("--throughput-seconds", type=float, default=20.0)
    parser.add_argument("--cases", nargs="*", default=None, help="only these flood cases")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--logs", default=None, help="folder for the worker's and gateway's logs")
    args = parser.parse_args(argv)

    from inferplane.bench.gateway import _model_dir
    from inferplane.bench.gateway_harness import free_port, start_gateway, start_worker, stop_worker, wait_serving

    model = _model_dir(args.model_dir)
    logs = args.logs or tempfile.mkdtemp(prefix="inferplane-bench-fairness-")
    os.makedirs(logs, exist_ok=True)
    adapters = None
    if _adapter_cases(args):
        from pathlib import Path


        adapters = AdapterSetup.prepare(Path(logs) / "adapters", model)
    port = free_port()
    worker = start_worker(model, port, "--runtime", args.runtime, "--max-num-seqs", str(args.max_num_seqs),
                          "--max-model-len", "1024", *(adapters.worker_args() if adapters else ()),
                          log_path=os.path.join(logs, "worker.log"))
    gateway = None
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, worker)
        tenants = ("interactive", "flood", "critical:critical", "batch:batch", f"{LIMITED},rpm=5")
        gateway = start_gateway([address], log_path=os.path.join(logs, "gateway.log"),
                                extra=tuple(arg for name in tenants for arg in ("--tenant", name))
                                + (adapters.gateway_args() if adapters else ()))
        print(f"tiny model, {args.runtime} runtime, {args.max_num_seqs} slots; {os.cpu_count()} CPUs; "
              f"logs: {logs}", flush=True)
        results = asyncio.run(run(args, Tenants(gateway.base_url, gateway.keys, "tiny"),
                                  adapters.with_keys(gateway) if adapters else None))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        if gateway is not None:
            gateway.stop()
        stop_worker(worker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
