"""The `/v1/responses` route's own decisions, through a gateway's whole ASGI app and a real gRPC
worker that answers one token: a conversation too large to store is refused before anything is
generated; a stream that breaks after it started ends with OpenAI's error events and stores
nothing. (The whole API through the `openai` client and a real model: tests/e2e/test_responses_api.py.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from inferplane.control_plane import auth, stored_responses, tenants
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.v1 import worker_pb2
from tests.control_plane.fake_worker import RecordingWorker, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")


class BreakingWorker(RecordingWorker):
    """Answers one token, then breaks mid-answer when `breaks` is set."""

    breaks = False

    async def Generate(self, request: worker_pb2.GenerateRequest,  # noqa: N802 - gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.requests.append(request)
        if self.breaks:
            yield worker_pb2.GenerateResponse(index=0, text="x", token_ids=[5])
            await context.abort(grpc.StatusCode.INTERNAL, "the replica broke mid-answer")
        yield worker_pb2.GenerateResponse(index=0, text="x", token_ids=[5], finished=True, finish_reason="stop",
                                          usage=worker_pb2.Usage(completion_tokens=1))


@pytest.fixture
async def served(tmp_path, tokenizer):
    worker = BreakingWorker(tokenizer)
    server, address = await serve(worker)
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test")
        key = auth.create_key(s, "t", actor="test").secret
    gw.keys.refresh()
    route_to(gw, address, tokenizer)
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30,
                                 headers={"authorization": f"Bearer {key}"}) as client:
        yield client, worker
    await server.stop(None)


async def test_a_conversation_too_large_to_store_is_refused_before_generating(served, monkeypatch) -> None:
    client, worker = served
    first = await client.post("/v1/responses", json={"model": "m", "input": "Hi"})
    assert first.status_code == 200, first.text
    follow = {"model": "m", "previous_response_id": first.json()["id"], "input": "Go on."}
    whole = [{"type": "message", "role": "user", "content": "Hi"}, *first.json()["output"],
             {"type": "message", "role": "user", "content": "Go on."}]
    monkeypatch.setattr(stored_responses, "MAX_CONVERSATION_BYTES", stored_responses.conversation_bytes(whole) - 1)
    refused = await client.post("/v1/responses", json=follow)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("previous_response_id", "conversation_too_large")
    assert len(worker.requests) == 1  # nothing generated for it
    # unstored, the same conversation is served
    unstored = await client.post("/v1/responses", json={**follow, "store": False})
    assert unstored.status_code == 200, unstored.text
    # and a first turn over the bound names the input
    monkeypatch.setattr(stored_responses, "MAX_CONVERSATION_BYTES", 40)
    alone = await client.post("/v1/responses", json={"model": "m", "input": "Hi"})
    assert alone.json()["error"]["param"] == "input"


async def test_a_stream_that_breaks_ends_with_error_events_and_stores_nothing(served) -> None:
    client, worker = served
    worker.breaks = True
    answer = await client.post("/v1/responses", json={"model": "m", "input": "Hi", "stream": True})
    assert answer.status_code == 200
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    response_id = events[0]["response"]["id"]
    assert (await client.get(f"/v1/responses/{response_id}")).status_code == 404
    worker.breaks = False
    whole = await client.post("/v1/responses", json={"model": "m", "input": "Hi", "stream": True})
    last = [json.loads(line[6:]) for line in whole.text.splitlines() if line.startswith("data: ")][-1]
    assert last["type"] == "response.completed"
    stored = await client.get(f"/v1/responses/{last['response']['id']}")
    assert stored.json() == last["response"]
