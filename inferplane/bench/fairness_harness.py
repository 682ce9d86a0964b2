"""The two-tenant fairness bench's harness: the interactive tenant's probe, the `/healthz` poller and
the flooding tenant's processes, shared by the flood cases (fairness.py) and the adapter cases
(fairness_adapters.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

CHAT = [{"role": "user", "content": "hello, how are you today?"}]
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


def row(name: str, p: Probe, h: Health, alone_p99: float) -> str:
    ratio = p.pct(0.99) / alone_p99 if alone_p99 else float("nan")
    return (f"  {name:<18} TTFT p50 {p.pct(0.5):8.1f} ms  p99 {p.pct(0.99):8.1f} ms  x{ratio:6.2f} of alone"
            f"   /healthz p99 {h.pct(0.99):7.1f} ms   samples {len(p.ttft_ms)} errors {p.errors}")
