"""`inferplane bench gateway`: what the gateway costs, against calling the worker directly.

One tiny-model worker process (paged runtime, CPU) and one gateway process (REST + tenant gRPC,
a real tenant key in a temporary SQLite database) are started; this process is the load
generator. Every request asks for one token, so the worker's compute is small and the figures are
about the request path: authentication, tokenization, limits, routing, HTTP and gRPC framing.

Modes, each a closed loop of N concurrent clients with a bounded request count and time:
  direct       grpc.aio Worker.Generate on one channel (the floor: what any caller pays)
  gateway-rest POST /v1/completions with the API key (raw HTTP/1.1 keep-alive, one connection per
               client; `--client httpx` uses httpx's pooled AsyncClient instead: on the two-core
               machine that shares its CPU with the gateway, httpx needed several times the client
               CPU per request and capped the measured rate well below what the gateway serves)
  gateway-grpc the tenant gRPC API, inferplane.v1.Inference/Complete
Figures: completed requests/s, latency p50/p99, and the latency the gateway adds (gateway minus
direct). Under saturation a closed loop's latency is concurrency / throughput, so the added
latency is also measured unloaded (one client, one request at a time), where it is the gateway's
own per-request cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

PROMPT = "Hello, how are you?"


@dataclass
class Result:
    mode: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    elapsed: float = 0.0
    cpu_ms: dict[str, float] = field(default_factory=dict)  # process -> CPU milliseconds per request

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all threads; None: this one). On a shared two-core
    machine wall-clock rates move with whatever else runs; CPU per request does not."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Call = Callable[[int], Awaitable[None]]  # argument: the client's index (raw HTTP uses it to pick its connection)


async def run_load(mode: str, call: Call, *, requests: int, concurrency: int, duration: float,
                   pids: dict[str, int | None] | None = None) -> Result:
    """`concurrency` clients each send one request after the other until `requests` were started
    or `duration` seconds passed. `pids` names the processes whose CPU time per request to report."""
    result = Result(mode, concurrency)
    cpu_before = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    started = 0
    deadline = time.perf_counter() + duration

    async def client(index: int) -> None:
        nonlocal started
        while started < requests and time.perf_counter() < deadline:
            started += 1
            t0 = time.perf_counter()
            try:
                await call(index)
            except Exception as exc:  # counted, never fatal: a benchmark reports what it saw
                result.errors += 1
                result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"[:300]
                continue
            result.latencies.append(time.perf_counter() - t0)

    t_start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    result.elapsed = time.perf_counter() - t_start
    done = max(1, len(result.latencies))
    result.cpu_ms = {name: (cpu_seconds(pid) - cpu_before[name]) * 1000 / done for name, pid in (pids or {}).items()}
    return result


# -- clients ---------------------------------------------------------------------------------------

class RawHTTP:
    """Minimal HTTP/1.1 keep-alive client over asyncio streams, one connection per load client.

    A load generator sharing two cores with the server must spend as little CPU per request as
    possible; this one does a write and two reads per request (httpx does far more, see --client)."""

    def __init__(self, host: str, port: int, path: str, body: bytes, headers: dict[str, str]):
        self.host, self.port = host, port
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}",
                "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        self.conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def __call__(self, index: int) -> None:
        conn = self.conns.get(index)
        if conn is not None and conn[0].at_eof():  # the server closed it while idle (keep-alive timeout)
            conn[1].close()
            conn = None
        if conn is None:
            conn = self.conns[index] = await asyncio.open_connection(self.host, self.port)
        reader, writer = conn
        try:
            writer.write(self.request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = None
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length is None:
                raise RuntimeError("response without Content-Length")
            body = await reader.readexactly(length)
        except Exception:
            self.conns.pop(index, None)
            writer.close()
            raise
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")

    async def close(self) -> None:
        for _, writer in self.conns.values():
            writer.close()
        self.conns.clear()


class HttpxClient:
    def __init__(self, base_url: str, path: str, body: bytes, headers: dict[str, str], connections: int):
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60)
        self.path, self.body = path, body
        self.headers = {**headers, "Content-Type": "application/json"}

    async def __call__(self, index: int) -> None:
        response = await self.client.post(self.path, content=self.body, headers=self.headers)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    async def close(self) -> None:
        await self.client.aclose()


def grpc_direct(address: str, token_ids: list[int]) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import grpc

    from inferplane.v1 import worker_pb2, worker_pb2_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    params = worker_pb2.SamplingParams(max_tokens=1, temperature=0.0)

    async def call(index: int) -> None:
        request = worker_pb2.GenerateRequest(params=params, token_ids=worker_pb2.TokenIds(ids=token_ids))
        async for msg in stub.Generate(request, timeout=60):
            if msg.finished:
                return
        raise RuntimeError("stream ended without a finished message")

    return call, channel.close


def grpc_gateway(address: str, key: str, model: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import grpc

    from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

    channel = grpc.aio.insecure_channel(address)
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.CompleteRequest(model=model, prompt=PROMPT,
                                            params=worker_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    metadata = (("authorization", f"Bearer {key}"),)

    async def call(index: int) -> None:
        async for msg in stub.Complete(request, metadata=metadata, timeout=60):
            if msg.finished:
                return
        raise RuntimeError("stream ended without a finished message")

    return call, channel.close


# -- orchestration ---------------------------------------------------------------------------------

def _row(r: Result) -> str:
    errors = f"{r.errors} ({r.first_error})" if r.errors else "0"
    cpu = " ".join(f"{r.cpu_ms.get(name, 0.0):>6.2f}" for name in _PROCS)
    return (f"{r.mode:<22} {r.concurrency:>5} {len(r.latencies):>7} {r.rps:>9.0f} {r.pct(0.5):>9.2f} "
            f"{r.pct(0.99):>9.2f}  {cpu}   {errors}")


_PROCS = ("client", "gateway", "worker")


async def _measure(args: argparse.Namespace, worker: str, gw_port: int, gw_grpc: int, key: str,
                   token_ids: list[int], pids: dict[str, int | None]) -> list[tuple[str, Result, Result]]:
    """Returns (label, direct, gateway) pairs for the added-latency lines; prints each mode's row."""
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Authorization": f"Bearer {key}"}
    direct_call, direct_close = grpc_direct(worker, token_ids)
    grpc_call, grpc_close = grpc_gateway(f"127.0.0.1:{gw_grpc}", key, "tiny")
    clients = {"raw": lambda: RawHTTP("127.0.0.1", gw_port, "/v1/completions", body, headers),
               "httpx": lambda: HttpxClient(f"http://127.0.0.1:{gw_port}", "/v1/completions", body, headers,
                                            args.concurrency)}
    rest_clients = {name: make() for name, make in clients.items() if args.client in (name, "both")}
    modes: list[tuple[str, Call]] = [("direct (worker gRPC)", direct_call)]
    modes += [(f"gateway REST ({name})", c) for name, c in rest_clients.items()]
    if not args.no_grpc_gateway:
        modes.append(("gateway gRPC", grpc_call))
    print(f"{'':<54}  CPU ms per request")
    print(f"{'mode':<22} {'conc':>5} {'ok':>7} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9}  "
          + " ".join(f"{name[:6]:>6}" for name in _PROCS) + "   errors")
    loaded: dict[str, Result] = {}
    unloaded: dict[str, Result] = {}
    try:
        for label, call in modes:
            await run_load(label, call, requests=args.warmup, concurrency=args.concurrency, duration=args.duration)
            loaded[label] = await run_load(label, call, requests=args.requests, concurrency=args.concurrency,
                                           duration=args.duration, pids=pids)
            print(_row(loaded[label]), flush=True)
        for label, call in modes:
            unloaded[label] = await run_load(label, call, requests=args.unloaded_requests, concurrency=1,
                                             duration=args.duration, pids=pids)
            print(_row(unloaded[label]), flush=True)
    finally:
        for c in rest_clients.values():
            await c.close()
        await direct_close()
        await grpc_close()
    direct = modes[0][0]
    pairs = []
    for label, _ in modes[1:]:
        pairs.append((f"{label}, {args.concurrency} clients", loaded[direct], loaded[label]))
        pairs.append((f"{label}, 1 client", unloaded[direct], unloaded[label]))
    return pairs


def _model_dir(arg: str | None) -> str:
    from inferplane.bench.tiny_model import make_tiny_model

    return make_tiny_model(arg or os.path.join(tempfile.gettempdir(), "inferplane-tiny-model"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferplane bench gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="requests per loaded mode")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds at most per mode")
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--unloaded-requests", type=int, default=300, help="requests per mode with one client")
    parser.add_argument("--client", choices=["raw", "httpx", "both"], default="raw", help="REST load client")
    parser.add_argument("--no-grpc-gateway", action="store_true", help="skip the tenant gRPC API")
    parser.add_argument("--model-dir", default=None, help="where the tiny model is kept (created if missing)")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--logs", default=None, help="folder for the worker's and gateway's logs")
    args = parser.parse_args(argv)

    from inferplane.bench.gateway_harness import free_port, start_gateway, start_worker, stop_worker, wait_serving
    from inferplane.worker.model.tokenizer import load_hf_tokenizer

    model = _model_dir(args.model_dir)
    token_ids = load_hf_tokenizer(model).encode(PROMPT)
    logs = args.logs or tempfile.mkdtemp(prefix="inferplane-bench-gw-")
    os.makedirs(logs, exist_ok=True)
    port = free_port()
    worker = start_worker(model, port, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "256",
                          log_path=os.path.join(logs, "worker.log"))
    gateway = None
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, worker)
        gateway = start_gateway([address], log_path=os.path.join(logs, "gateway.log"))
        print(f"tiny model: {model}; worker pid {worker.pid}, gateway pid {gateway.proc.pid}; logs: {logs}")
        print(f"{os.cpu_count()} CPUs; every request: max_tokens=1, prompt {len(token_ids)} tokens")
        pids = {"client": None, "gateway": gateway.proc.pid, "worker": worker.pid}
        pairs = asyncio.run(_measure(args, address, gateway.port, gateway.grpc_port, gateway.key, token_ids, pids))
        print("\nlatency the gateway adds (gateway minus direct):")
        for label, direct, through in pairs:
            print(f"  {label:<36} p50 {through.pct(0.5) - direct.pct(0.5):+8.2f} ms   "
                  f"p99 {through.pct(0.99) - direct.pct(0.99):+8.2f} ms")
        rest = [r for label, _, r in pairs if "REST" in label and "1 client" not in label]
        added = [t.pct(0.5) - d.pct(0.5) for label, d, t in pairs if "REST" in label and "1 client" in label]
        if rest:
            print(f"\nthroughput through the gateway (REST, best client): {max(r.rps for r in rest):.0f} req/s "
                  f"(target >= 1000); added p50 unloaded: {min(added):.2f} ms (target <= 2)")
    finally:
        if gateway is not None:
            gateway.stop()
        stop_worker(worker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
