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
import contextlib
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

CHAT = [{"role": "user", "content": "hello, how are you today?"}]
LIMITED = "limited"  # a tenant whose key may send 5 requests a minute (`refused-prompts`)
ADAPTER_CASES = ("adapter-poison", "adapter-patterns")  # bench/fairness_adapters.py runs them
PROBE_MAX_TOKENS = 4


@dataclass
class Probe:
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0

    def pct(self, q: float) -> float:
        if not self.ttft_ms:
            return float("nan")
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Health:
    latency_ms: list[float] = field(default_factory=list)

    def pct(self, q: float) -> float:
        ordered = sorted(self.latency_ms) or [float("nan")]
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Tenants:
    """The gateway's base URL and one key per tenant."""

    def __init__(self, base_url: str, keys: dict[str, str], model: str):
        self.base_url = base_url
        self.keys = keys
        self.model = model

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


async def _ttft(client: httpx.AsyncClient, t: Tenants, tenant: str) -> float:
    """Milliseconds from sending a streamed chat to its first content chunk."""
    body = {"model": t.model, "messages": CHAT, "max_tokens": PROBE_MAX_TOKENS, "stream": True, "temperature": 0}
    start = time.perf_counter()
    async with client.stream("POST", f"{t.base_url}/v1/chat/completions", json=body,
                             headers=t.headers(tenant)) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"probe: HTTP {response.status_code}: {response.text[:200]}")
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                chunk = json.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = (time.perf_counter() - start) * 1000
        if first is None:
            raise RuntimeError("probe: the stream had no content")
        return first


async def probe(t: Tenants, tenant: str, samples: int) -> Probe:
    result = Probe()
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(samples):
            try:
                result.ttft_ms.append(await _ttft(client, t, tenant))
            except Exception:  # noqa: BLE001 - counted and shown, never hidden
                result.errors += 1
    return result


async def poll_health(base_url: str, stop: asyncio.Event, health: Health) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            with contextlib.suppress(httpx.HTTPError):
                await client.get(f"{base_url}/healthz")
            health.latency_ms.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.02)


# -- floods -----------------------------------------------------------------------------------------
# A flood runs in a process of its own: in the probe's process its client work (encoding 100,000
# choices, reading 128 answers) would delay the probe's own event loop and be counted as TTFT.


@dataclass(frozen=True)
class Flood:
    """What the flooding tenant sends, `copies` at once, again as soon as each is answered: a chat
    with `extra` fields, or (`body_mb`) an unauthenticated chunked POST of that many MiB, or
    (`heads`) request heads that never end: half dribbled, half huge."""

    tenant: str
    copies: int
    extra: dict = field(default_factory=dict)
    body_mb: int = 0
    heads: bool = False


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


async def _unfinished_head(base_url: str, slow: bool) -> None:
    """One connection's head that never ends: a byte every 100 ms, or a MiB at a time up to 64 MiB;
    returns when the gateway closes the connection (or the head is all sent)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    closed = asyncio.ensure_future(reader.read())  # done once the gateway has answered and closed
    closed.add_done_callback(lambda f: f.cancelled() or f.exception())  # a reset is expected, not news
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nx-pad: ")
        for _ in range(600 if slow else 64):  # slow: a minute, longer than any head may take
            writer.write(b"a" if slow else b"a" * (1 << 20))
            await writer.drain()
            if slow:
                await asyncio.sleep(0.1)
            if closed.done():
                break
    except (ConnectionError, OSError):
        pass
    finally:
        closed.cancel()
        writer.close()


async def _flood_loop(t: Tenants, flood: Flood, stop, served: list[tuple[float, int]]) -> None:
    """`flood.copies` loops until `stop` (a multiprocessing Event) is set; each answer is recorded
    as (finish time, completion tokens)."""
    body = json.dumps({"model": t.model, "messages": CHAT, "temperature": 0, **flood.extra}).encode()
    headers = {**t.headers(flood.tenant), "Content-Type": "application/json"} if not flood.body_mb else \
        {"Content-Type": "application/json"}

    async def chunks():
        block = b"x" * (1 << 20)
        for _ in range(flood.body_mb):
            yield block

    limits = httpx.Limits(max_connections=flood.copies + 4, max_keepalive_connections=flood.copies + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def loop(index: int) -> None:
            while not stop.is_set():
                tokens = 0
                try:
                    if flood.heads:
                        await _unfinished_head(t.base_url, slow=index % 2 == 0)
                    elif flood.body_mb:
                        await client.post(f"{t.base_url}/admin/v1/tenants", content=chunks(), headers=headers)
                    else:
                        response = await client.post(f"{t.base_url}/v1/chat/completions", content=body,
                                                     headers=headers)
                        if response.status_code == 200:
                            tokens = int(response.json().get("usage", {}).get("completion_tokens", 0))
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
                served.append((time.time(), tokens))

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(loop(i)) for i in range(flood.copies)]
        await watch()
        for task in tasks:
            task.cancel()  # a cancelled request disconnects: the gateway and worker drop it
        await asyncio.gather(*tasks, return_exceptions=True)


def _flood_process(t: Tenants, flood: Flood, stop, results) -> None:
    served: list[tuple[float, int]] = []
    asyncio.run(_flood_loop(t, flood, stop, served))
    results.put(served)


class FloodProcess:
    """A flood in a child process: start, then `stop()` returns what it was served (whatever
    `target(t, flood, stop, results)` put on `results`: the adapter floods report more)."""

    def __init__(self, t: Tenants, flood, target: Callable = _flood_process):
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._results = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=target, args=(t, flood, self._stop, self._results), daemon=True)
        self._proc.start()

    async def stop(self):
        self._stop.set()
        served = await asyncio.to_thread(self._results.get, True, 120)
        await asyncio.to_thread(self._proc.join, 30)
        return served


async def measure(t: Tenants, tenant: str, samples: int, flood: Flood | None,
                  warmup_s: float) -> tuple[Probe, Health]:
    stop, health = asyncio.Event(), Health()
    poller = asyncio.create_task(poll_health(t.base_url, stop, health))
    flooding = FloodProcess(t, flood) if flood is not None else None
    if flooding is not None:
        await asyncio.sleep(warmup_s)
    result = await probe(t, tenant, samples)
    stop.set()
    if flooding is not None:
        await flooding.stop()
    await poller
    return result, health


async def throughput(t: Tenants, tenant: str, copies: int, seconds: float, *,
                     alongside: Callable[[], Awaitable[object]] | None = None) -> float:
    """Completion tokens/s the tenant's backlog (`copies` generations at once) is served, counted
    over `seconds` after a warm-up, optionally while `alongside` runs."""
    flooding = FloodProcess(t, Flood(tenant, copies, {"max_tokens": 100}))
    await asyncio.sleep(seconds / 4)
    start = time.time()
    side = asyncio.create_task(_repeat(alongside, time.perf_counter() + seconds)) if alongside else None
    await asyncio.sleep(seconds)
    end = time.time()
    if side is not None:
        side.cancel()
        await asyncio.gather(side, return_exceptions=True)
    served = await flooding.stop()
    return sum(tokens for when, tokens in served if start <= when <= end) / (end - start)


async def _repeat(job: Callable[[], Awaitable[object]], until: float) -> None:
    while time.perf_counter() < until:
        await job()


def _row(name: str, p: Probe, h: Health, alone_p99: float) -> str:
    ratio = p.pct(0.99) / alone_p99 if alone_p99 else float("nan")
    return (f"  {name:<18} TTFT p50 {p.pct(0.5):8.1f} ms  p99 {p.pct(0.99):8.1f} ms  x{ratio:6.2f} of alone"
            f"   /healthz p99 {h.pct(0.99):7.1f} ms   samples {len(p.ttft_ms)} errors {p.errors}")


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
    print(_row("alone", alone, health, alone.pct(0.99)), flush=True)
    results["alone"] = {"p50": alone.pct(0.5), "p99": alone.pct(0.99), "healthz_p99": health.pct(0.99)}
    cases = flood_cases(slots)
    for name in [n for n in args.cases or list(cases) if n not in ADAPTER_CASES]:
        p, h = await measure(t, "interactive", args.samples, cases[name], args.warmup)
        print(_row(name, p, h, alone.pct(0.99)), flush=True)
        results["cases"][name] = {"p50": p.pct(0.5), "p99": p.pct(0.99), "healthz_p99": h.pct(0.99),
                                  "ratio": p.pct(0.99) / alone.pct(0.99), "errors": p.errors}
    if adapters is not None:
        from inferplane.bench.fairness_adapters import run_cases

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
    print(_row("critical alone", critical_alone, Health(), critical_alone.pct(0.99)), flush=True)
    print(_row("critical + batch", critical, h, critical_alone.pct(0.99)), flush=True)
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

        from inferplane.bench.fairness_adapters import AdapterSetup

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
