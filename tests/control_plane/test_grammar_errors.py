"""Issue 29, item 2, gateway side: a worker that ends a request with INVALID_ARGUMENT after it began
answering (a structured output its grammar engine gave up on mid-output) is the request's error: a
400 naming the field (an error event when streaming), never a 200 nor a "replica failed" 503.
"""

from __future__ import annotations

import json

import grpc
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.v1 import worker_pb2
from tests.control_plane.fake_worker import RecordingWorker, complete, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

MESSAGE = ("structured_outputs: regex: the grammar engine gave up on this constraint after 1 output tokens "
           "(too complex to enforce); the output was discarded")


class GivesUpMidOutput(RecordingWorker):
    """One token, then the worker's answer to a grammar that gave up."""

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        yield worker_pb2.GenerateResponse(text="d", token_ids=[5])
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE)




async def test_a_grammar_that_gives_up_after_the_first_token_is_a_400_naming_the_field(tmp_path, tokenizer):
    worker = GivesUpMidOutput(tokenizer)
    server, address = await serve(worker)
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    try:
        with gw.sessions.begin() as s:
            tenants.create_tenant(s, "t", actor="test")
            key = auth.create_key(s, "t", actor="test").secret
        gw.keys.refresh()
        route_to(gw, address, tokenizer)
        body = {"max_tokens": 5, "structured_outputs": {"regex": "(bx|d(a{10}){10})"}}

        answer = await complete(gw, key, **body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["message"], error["param"]) == (MESSAGE, "structured_outputs")

        streamed = await complete(gw, key, stream=True, **body)
        events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
        last = json.loads(events[-1])
        assert last["error"]["message"] == MESSAGE and last["error"]["param"] == "structured_outputs"
        assert len(worker.requests) == 2  # not retried on another replica
    finally:
        gw.engine.dispose()
        await server.stop(None)
