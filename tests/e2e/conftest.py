"""Fixtures for end-to-end tests that need one real tiny-model worker behind an in-process gateway
(so that a test can create tenants and keys, or change the gateway's settings, directly)."""

from __future__ import annotations

import pytest

from inferplane.bench.gateway_harness import free_port, start_worker, wait_serving
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import Deployment, StaticEndpointSource
from inferplane.worker.model.tokenizer import load_hf_tokenizer


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory):
    """(model folder, address) of a worker with a 256-token context and room for 32 sequences."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    proc = start_worker(model, int(address.rsplit(":", 1)[1]), "--max-model-len", "256", "--max-num-seqs", "32",
                        log_path=str(log))
    try:
        wait_serving(address, proc)
        yield model, address
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def in_process_gateway(tiny_worker, tmp_path):
    """A gateway serving the tiny worker as model "m", with a SQLite database of its own."""
    model, address = tiny_worker
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    gw.catalog.put(ServedModel(name="m", tokenizer=load_hf_tokenizer(model), max_model_len=256))
    gw.router.set_route("m", [Deployment("d", StaticEndpointSource([address]))])
    yield gw
    gw.engine.dispose()


def openai_client(gw: Gateway, tenant: str = "e2e"):
    """The official async client talking to `gw` in process, with a new tenant's key."""
    import httpx
    from openai import AsyncOpenAI

    from inferplane.control_plane import auth, tenants
    from inferplane.control_plane.gateway.rest import create_asgi_app

    with gw.sessions.begin() as session:
        tenants.create_tenant(session, tenant, actor="test")
        key = auth.create_key(session, tenant, actor="test").secret
    gw.keys.refresh()
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    return AsyncOpenAI(base_url="http://gw/v1", api_key=key, timeout=300,
                       http_client=httpx.AsyncClient(transport=transport, base_url="http://gw"))


@pytest.fixture
async def grpc_stub(in_process_gateway):
    """The tenant gRPC API of the in-process gateway, and a key for it."""
    import grpc

    from inferplane.control_plane import auth, tenants
    from inferplane.control_plane.gateway.grpc_api import InferenceServicer
    from inferplane.v1 import inference_pb2_grpc

    gw = in_process_gateway
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "grpc", actor="test")
        key = auth.create_key(session, "grpc", actor="test").secret
    gw.keys.refresh()
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(gw.context), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield inference_pb2_grpc.InferenceStub(channel), [("authorization", f"Bearer {key}")]
    await server.stop(None)
