"""One route from a request to the worker's SamplingParams (inference.py's module docstring).

Every API builds the worker request the same way: REST completions and chat (through the fast
path) and the gRPC API's Complete and Chat send a real gRPC worker the same SamplingParams for the
same request, max_tokens settled by the gateway (the one asked for, or the room the prompt leaves
in the context), the gRPC API adding only its own fields (stop_token_ids, ignore_eos). Each layer
refuses what it checks with a 400 naming the field the client sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.grpc_api import InferenceServicer
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2
from tests.control_plane.fake_worker import RecordingWorker, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

CONTEXT = 256  # route_to's max_model_len
MESSAGES = [{"role": "user", "content": "hi"}]

# The same sampling, as a REST body's fields and as the gRPC API's SamplingParams.
REST_SAMPLING: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": ["x"], "seed": 3, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "repetition_penalty": 1.25, "logit_bias": {"7": 1.0}, "min_tokens": 1, "n": 2,
}
GRPC_SAMPLING: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": ["x"], "seed": 3, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "repetition_penalty": 1.25, "logit_bias": {7: 1.0}, "min_tokens": 1, "n": 2,
    "logprobs": True, "top_logprobs": 2,
}


@dataclass
class Served:
    gateway: Gateway
    worker: RecordingWorker
    key: str
    grpc_address: str


@pytest.fixture
async def served(tmp_path: Path, tokenizer) -> AsyncIterator[Served]:
    worker = RecordingWorker(tokenizer)
    worker_server, address = await serve(worker)
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t", actor="test")
        key = auth.create_key(session, "t", actor="test").secret
    gw.keys.refresh()
    route_to(gw, address, tokenizer)
    api = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(gw.context), api)
    port = api.add_insecure_port("127.0.0.1:0")
    await api.start()
    try:
        yield Served(gw, worker, key, f"127.0.0.1:{port}")
    finally:
        await api.stop(None)
        await worker_server.stop(None)
        gw.engine.dispose()


async def _rest(s: Served, chat: bool, body: dict[str, Any]) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": MESSAGES} if chat else {"prompt": "hi"}
    transport = httpx.ASGITransport(create_asgi_app(s.gateway.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
        return await client.post(path, headers={"authorization": f"Bearer {s.key}"},
                                 json={"model": "m", **prompt, **body})


async def _grpc(s: Served, chat: bool, params: worker_pb2.SamplingParams) -> None:
    metadata = [("authorization", f"Bearer {s.key}")]
    async with grpc.aio.insecure_channel(s.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        if chat:
            call = stub.Chat(inference_pb2.ChatRequest(model="m", params=params, messages=[
                worker_pb2.ChatMessage(**m) for m in MESSAGES]), metadata=metadata, timeout=30)
        else:
            call = stub.Complete(inference_pb2.CompleteRequest(model="m", prompt="hi", params=params),
                                 metadata=metadata, timeout=30)
        async for _ in call:
            pass


def _room(s: Served, chat: bool) -> int:
    tokenizer = s.gateway.catalog.get("m", None).tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) if chat else "hi"
    return CONTEXT - len(tokenizer.encode(text))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("asked", [5, None], ids=["max_tokens", "implicit"])
async def test_rest_and_grpc_send_the_worker_the_same_sampling_params(served: Served, chat: bool,
                                                                      asked: int | None) -> None:
    logprobs = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    answer = await _rest(served, chat, {**REST_SAMPLING, **logprobs, "max_tokens": asked})
    assert answer.status_code == 200, answer.text
    extras = {"stop_token_ids": [3, 4], "ignore_eos": True}
    await _grpc(served, chat, worker_pb2.SamplingParams(max_tokens=asked or 0, **GRPC_SAMPLING, **extras))
    by_rest, by_grpc = (r.params for r in served.worker.requests)
    assert by_rest.max_tokens == (asked or _room(served, chat))
    assert (list(by_grpc.stop_token_ids), by_grpc.ignore_eos) == ([3, 4], True)  # the gRPC API's own fields
    del by_grpc.stop_token_ids[:]
    by_grpc.ignore_eos = False
    assert by_grpc == by_rest


@pytest.mark.parametrize(("chat", "body", "param"), [
    (False, {"max_tokens": 0}, "max_tokens"),
    (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (True, {"max_tokens": 2**32}, "max_tokens"),
    (False, {"max_tokens": CONTEXT}, "max_tokens"),  # more than the prompt leaves in the context
    (True, {"max_completion_tokens": CONTEXT}, "max_tokens"),
], ids=["range", "range-chat", "wire-range", "room", "room-chat"])
async def test_a_max_tokens_a_layer_refuses_is_a_400_naming_it(served: Served, chat: bool, body: dict,
                                                              param: str) -> None:
    answer = await _rest(served, chat, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert served.worker.requests == []
