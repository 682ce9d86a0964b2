"""`inferplane bench autoscale`: the local stack through steady load → 10x burst → idle → one request.

Runs `LocalPlatform` (real worker processes, the tiny random model on CPU, two sequence slots per
replica so that load shows quickly) with an autoscaled deployment (minReplicas 0) and short
windows, drives it with streaming requests, and prints: time from the burst's start to the first
scale-up decision and to the new replica serving, failed requests, TTFT p50/p95 steady vs during the
burst, time back to the minimum after the load stops, and the scale-from-zero latency against the
worker's cold start. With matplotlib installed it writes a PNG of load, replicas (desired vs ready)
and TTFT over time. A benchmark, not a test: it measures and prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inferplane.api.deployment import InferenceDeploymentSpec


@dataclass
class Timeline:
    start: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, in flight, desired, ready)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (t, seconds)
    failures: int = 0
    in_flight: int = 0

    def now(self) -> float:
        return time.monotonic() - self.start


def _spec(model: str, args: argparse.Namespace) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.from_dict({
        "model": {"uri": model, "format": "safetensors"}, "runtime": "paged",
        "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1, "minReplicas": 0, "maxReplicas": args.max_replicas,
        "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256, "maxNumSeqs": 2},
        "autoscaling": {"enabled": True, "targetQueueDepth": 1, "stableWindowSeconds": args.stable_window,
                        "panicWindowSeconds": args.panic_window, "scaleDownDelaySeconds": args.scale_down_delay,
                        "idleSeconds": args.idle, "queueTimeoutSeconds": 300}})


async def _request(client: httpx.AsyncClient, url: str, key: str, timeline: Timeline, max_tokens: int) -> float:
    timeline.in_flight += 1
    sent = time.monotonic()
    first = None
    try:
        async with client.stream("POST", url, headers={"authorization": f"Bearer {key}"},
                                 json={"model": "bench", "prompt": "tell me a long story", "max_tokens": max_tokens,
                                       "stream": True}) as response:
            if response.status_code != 200:
                timeline.failures += 1
                return float("nan")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - sent
                    timeline.ttfts.append((timeline.now(), first))
                if '"error"' in line:
                    timeline.failures += 1
    except httpx.HTTPError:
        timeline.failures += 1
    finally:
        timeline.in_flight -= 1
    return first if first is not None else float("nan")


async def _load(client, url, key, timeline: Timeline, concurrency: int, seconds: float, max_tokens: int) -> None:
    deadline = time.monotonic() + seconds

    async def user() -> None:
        while time.monotonic() < deadline:
            await _request(client, url, key, timeline, max_tokens)

    await asyncio.gather(*(user() for _ in range(concurrency)))


def _pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_benchmark(args: argparse.Namespace) -> dict:
    from inferplane.bench.tiny_model import make_tiny_model
    from inferplane.local.platform import LocalPlatform, Manifest

    work = Path(tempfile.mkdtemp(prefix="inferplane-bench-autoscale-"))
    model = args.model or make_tiny_model(work / "tiny")
    port = _free_port()
    platform = LocalPlatform(work / "home", [Manifest("bench", _spec(model, args))], "127.0.0.1", port, None,
                             autoscale_interval=0.25)
    timeline = Timeline()
    cold_start_began = time.monotonic()
    await platform.start()
    if not await platform.wait_ready(600):
        raise SystemExit(f"the worker did not start: {platform.supervisor.failed_to_start()}")
    cold_start = time.monotonic() - cold_start_began
    deployment = platform.supervisor.deployments["bench"]
    target = platform.autoscaler.targets["bench"]

    async def sample() -> None:
        while True:
            desired = target.last.desired if target.last else len(deployment.replicas)
            ready = sum(r.ready for r in deployment.replicas)
            timeline.rows.append((timeline.now(), timeline.in_flight, desired, ready))
            await asyncio.sleep(0.25)

    sampler = asyncio.get_running_loop().create_task(sample())
    url = f"http://127.0.0.1:{port}/v1/completions"
    key = platform.tenant_key
    results: dict = {"cold_start_s": cold_start}
    try:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
            steady_from = timeline.now()
            await _load(client, url, key, timeline, args.steady, args.phase, args.max_tokens)
            burst_from = timeline.now()
            await _load(client, url, key, timeline, args.steady * 10, args.phase, args.max_tokens)
            burst_to = timeline.now()
            results["ttft_steady"] = [t for at, t in timeline.ttfts if steady_from <= at < burst_from]
            results["ttft_burst"] = [t for at, t in timeline.ttfts if burst_from <= at < burst_to]
            ups = [at for at, _, desired, _ in timeline.rows if at >= burst_from and desired > 1]
            ready2 = [at for at, _, _, ready in timeline.rows if at >= burst_from and ready > 1]
            results["to_decision_s"] = (ups[0] - burst_from) if ups else None
            results["to_serving_s"] = (ready2[0] - burst_from) if ready2 else None
            idle_from = timeline.now()
            while len(deployment.replicas) > 0:
                await asyncio.sleep(0.25)
            results["back_to_min_s"] = timeline.now() - idle_from
            woke = time.monotonic()
            results["from_zero_ttft_s"] = await _request(client, url, key, timeline, 8)
            results["from_zero_s"] = time.monotonic() - woke
            results["failures"] = timeline.failures
            results["requests"] = len(timeline.ttfts) + timeline.failures
    finally:
        sampler.cancel()
        await platform.stop()
    results["timeline"] = timeline
    results["burst_from"] = burst_from
    return results


def _chart(results: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    timeline: Timeline = results["timeline"]
    t = [r[0] for r in timeline.rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.plot(t, [r[1] for r in timeline.rows], label="requests in flight", color="tab:gray")
    top.step(t, [r[2] for r in timeline.rows], where="post", label="desired replicas", color="tab:blue")
    top.step(t, [r[3] for r in timeline.rows], where="post", label="ready replicas", color="tab:green")
    top.axvline(results["burst_from"], linestyle=":", color="tab:red")
    top.set_ylabel("count")
    top.legend(loc="upper right")
    bottom.scatter([a for a, _ in timeline.ttfts], [v for _, v in timeline.ttfts], s=6, color="tab:orange")
    bottom.set_ylabel("TTFT (s)")
    bottom.set_xlabel("seconds")
    fig.suptitle("inferplane autoscaling: steady → 10x burst → idle → one request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"chart: {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferplane bench autoscale", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="weights folder (default: the tiny random model)")
    parser.add_argument("--steady", type=int, default=2, help="concurrent users in the steady phase (x10 in the burst)")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds of steady load, and of burst")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--stable-window", type=int, default=20)
    parser.add_argument("--panic-window", type=int, default=3)
    parser.add_argument("--scale-down-delay", type=int, default=10)
    parser.add_argument("--idle", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("autoscale.png"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    results = asyncio.run(run_benchmark(args))
    fmt = lambda v: "n/a" if v is None or v != v else f"{v:.2f}"  # noqa: E731
    print(f"requests {results['requests']}, failed {results['failures']}")
    print(f"burst start -> scale-up decision: {fmt(results['to_decision_s'])} s; "
          f"-> a new replica serving: {fmt(results['to_serving_s'])} s")
    for phase in ("steady", "burst"):
        values = results[f"ttft_{phase}"]
        print(f"TTFT {phase:<6} p50 {fmt(_pct(values, 0.5))} s  p95 {fmt(_pct(values, 0.95))} s  "
              f"({len(values)} requests)")
    print(f"load stopped -> back to the minimum (0): {fmt(results['back_to_min_s'])} s")
    print(f"request after idle: answered in {fmt(results['from_zero_s'])} s (first token "
          f"{fmt(results['from_zero_ttft_s'])} s); worker cold start {fmt(results['cold_start_s'])} s")
    print(_chart(results, args.out))
    if args.json:
        print(json.dumps({k: v for k, v in results.items() if k not in ("timeline", "ttft_steady", "ttft_burst")} |
                         {"ttft_steady_p50": _pct(results["ttft_steady"], 0.5),
                          "ttft_burst_p95": _pct(results["ttft_burst"], 0.95)}, default=str))
    return 0
