"""A real gRPC worker server that records what the gateway sends it, for the flow-control tests.

It answers every choice with one token, and can hold its answers until the test lets them go
(requests in flight, to run into concurrency limits) or fail before or after its first message.
A gateway built on SQLite routes a served model "m" to it, as it would to a real replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Literal

import grpc
import httpx

from inferplane.api.tokenizer import TextTokenizer
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway
from inferplane.control_plane.routing import Deployment, StaticEndpointSource
from inferplane.v1 import worker_pb2, worker_pb2_grpc


class RecordingWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.waiting = 0  # requests held at the gate now
        self.gate: asyncio.Event | None = None  # set: answers are held until it is
        self.fail: Literal["before", "after"] | None = None

    async def Generate(self, request: worker_pb2.GenerateRequest,  # noqa: N802 - gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.requests.append(request)
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        if self.fail == "before":
            await context.abort(grpc.StatusCode.INTERNAL, "the replica broke")
        for index in range(max(1, request.params.n)):
            if self.fail == "after" and index == 1:
                await context.abort(grpc.StatusCode.INTERNAL, "the replica broke mid-answer")
            yield worker_pb2.GenerateResponse(index=index, text="x", token_ids=[5], finished=True,
                                              finish_reason="stop", usage=worker_pb2.Usage(completion_tokens=1))

    async def Info(self, request: worker_pb2.InfoRequest,  # noqa: N802 - gRPC method name
                   context: grpc.aio.ServicerContext) -> worker_pb2.InfoResponse:
        return worker_pb2.InfoResponse(model="m", max_model_len=256, block_size=16, **self.tokenizer.to_wire())

    async def wait_for(self, waiting: int, timeout: float = 10.0) -> None:
        """Until `waiting` requests are held at the gate (they were admitted and routed)."""
        async with asyncio.timeout(timeout):
            while self.waiting < waiting:
                await asyncio.sleep(0.01)


async def serve(worker: RecordingWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def route_to(gw: Gateway, address: str, tokenizer: TextTokenizer, *, priority: str | None = None) -> None:
    """Serves model "m" through `gw` on the worker at `address`."""
    gw.catalog.put(ServedModel(name="m", tokenizer=tokenizer, max_model_len=256, priority=priority))
    gw.router.set_route("m", [Deployment("d", StaticEndpointSource([address]))])


async def complete(gw: Gateway, key: str, **body) -> httpx.Response:
    """POST /v1/completions through the gateway's whole ASGI app (fast path included)."""
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
        return await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                 json={"model": "m", "prompt": "hi", "max_tokens": 1, **body})
