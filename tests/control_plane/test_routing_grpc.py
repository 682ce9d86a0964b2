"""Against real grpc.aio servers on localhost: health polling and retry over Worker.Generate."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferplane.control_plane.routing import (
    Deployment,
    Endpoint,
    HealthPoller,
    HealthTracker,
    Router,
    RouteRequest,
    StaticEndpointSource,
    route_and_stream,
)
from inferplane.v1 import worker_pb2, worker_pb2_grpc


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, name: str) -> None:
        self.name = name

    async def Generate(self, request: worker_pb2.GenerateRequest,  # noqa: N802 - gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        for i in range(3):
            yield worker_pb2.GenerateResponse(text=f"{self.name}{i}", token_ids=[i])
        yield worker_pb2.GenerateResponse(finished=True, finish_reason="stop")


async def _serve(name: str) -> tuple[grpc.aio.Server, str, health.aio.HealthServicer]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(EchoWorker(name), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}", servicer


async def test_poller_tracks_serving_not_serving_and_down() -> None:
    server, addr, servicer = await _serve("w")
    tracker = HealthTracker(failure_threshold=2, cooldown_s=1e9)
    poller = HealthPoller(tracker, lambda: [addr], timeout_s=2.0)
    try:
        assert await poller.check_all() == {addr: True}
        assert tracker.is_healthy(addr)
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
        assert await poller.check_all() == {addr: False}
        assert not tracker.is_healthy(addr)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await poller.check_all() == {addr: True}
        assert tracker.is_healthy(addr)
        poller.service = "inferplane.v1.Worker"  # a service the server never registered: NOT_FOUND
        assert await poller.check(addr) is False
        poller.service = ""
        await server.stop(None)
        for _ in range(2):  # unreachable: ejected after failure_threshold failed checks
            assert await poller.check(addr) is False
        assert not tracker.is_healthy(addr)
    finally:
        await poller.close()
        await server.stop(None)


async def test_requests_move_off_a_stopped_worker() -> None:
    servers = [await _serve(n) for n in ("a", "b")]
    addrs = [addr for _, addr, _ in servers]
    router = Router({"m": [Deployment("d", StaticEndpointSource(addrs), block_size=4)]},
                    rng=random.Random(0))
    channels = {a: grpc.aio.insecure_channel(a) for a in addrs}

    def call(ep: Endpoint) -> AsyncIterator[worker_pb2.GenerateResponse]:
        stub = worker_pb2_grpc.WorkerStub(channels[ep.address])
        return stub.Generate(worker_pb2.GenerateRequest(request_id="r", text="hi"), timeout=5)

    try:
        await servers[0][0].stop(None)  # worker "a" is killed
        texts = set()
        # Which prompts hash to "a" depends on the ports the two servers got, so send until "a" has
        # failed often enough to be ejected (12 prompts were not always enough: ~2% of port pairs).
        for s in range(200):
            rnd = random.Random(s)
            req = RouteRequest("m", token_ids=[rnd.randrange(100) for _ in range(8)])
            msgs = [m async for m in route_and_stream(router, req, call)]
            assert msgs[-1].finished and len(msgs) == 4
            texts.add(msgs[0].text)
            if s >= 11 and not router.health.is_healthy(addrs[0]):
                break
        assert texts == {"b0"}  # every request answered, none by the stopped worker
        assert not router.health.is_healthy(addrs[0])
    finally:
        for ch in channels.values():
            await ch.close()
        for server, _, _ in servers:
            await server.stop(None)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC honours http_proxy for localhost targets in some environments."""
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.delenv(var, raising=False)
