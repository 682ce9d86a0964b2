"""Issue 53, item 9: what a tenant's error says about the platform.

A replica's address (and whatever a worker's internal failure says: file paths, other addresses)
goes to the gateway's log, never into a tenant's error, whether the request fails before routing
(every replica down), when a worker fails, or after an answer began streaming.
"""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from inferplane.bench.gateway_harness import free_port
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import NoReplicaAvailable, StreamBrokenAfterStart
from inferplane.v1 import worker_pb2
from tests.control_plane.fake_worker import RecordingWorker, complete, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

INTERNAL = "CUDA error in /opt/inferplane/worker/engine/engine.py line 812 (peer 10.42.7.19:50051)"


class FailsInternally(RecordingWorker):
    """A worker whose failure message holds what only operators may read, before or after a token."""

    def __init__(self, tokenizer, after_first: bool) -> None:
        super().__init__(tokenizer)
        self.after_first = after_first

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        if self.after_first:
            yield worker_pb2.GenerateResponse(text="d", token_ids=[5])
        await context.abort(grpc.StatusCode.INTERNAL, INTERNAL)


@pytest.fixture
def gateway(tmp_path):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t")
        gw.test_key = auth.create_key(s, "acme", actor="t").secret
    gw.keys.refresh()
    yield gw
    gw.engine.dispose()


def _leaks(text: str, *addresses: str) -> list[str]:
    secrets = [*addresses, *(a.rsplit(":", 1)[1] for a in addresses), "/opt/inferplane", "10.42.7.19", "CUDA"]
    return [s for s in secrets if s in text]


def test_routing_errors_name_no_address() -> None:
    for error in (NoReplicaAvailable("m", ("10.0.0.1:50051", "10.0.0.2:50051")),
                  StreamBrokenAfterStart("10.0.0.1:50051", 2)):
        assert "10.0.0" not in str(error) and "50051" not in str(error)
    assert NoReplicaAvailable("m", ("10.0.0.1:50051",)).tried == ("10.0.0.1:50051",)  # kept for the log
    assert StreamBrokenAfterStart("10.0.0.1:50051", 2).endpoint == "10.0.0.1:50051"


@pytest.mark.parametrize("stream", [False, True])
async def test_every_replica_down(gateway, tokenizer, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nobody listens there
    route_to(gateway, dead, tokenizer)
    with caplog.at_level(logging.WARNING):
        answer = await complete(gateway, gateway.test_key, stream=stream)
    assert answer.status_code == 503, answer.text
    assert _leaks(answer.text, dead) == [], answer.text
    assert dead in caplog.text  # the operator still learns which replica


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("after_first", [False, True])
async def test_a_worker_failure(gateway, tokenizer, stream: bool, after_first: bool,
                                caplog: pytest.LogCaptureFixture) -> None:
    worker = FailsInternally(tokenizer, after_first)
    server, address = await serve(worker)
    try:
        route_to(gateway, address, tokenizer)
        with caplog.at_level(logging.WARNING):
            answer = await complete(gateway, gateway.test_key, stream=stream)
    finally:
        await server.stop(None)
    if stream and after_first:  # the stream began: it ends with an error event
        assert answer.status_code == 200
        (event,) = [json.loads(line[6:]) for line in answer.text.splitlines()
                    if line.startswith("data: {") and '"error"' in line]
        assert event["error"]["code"] == "upstream_error"
    else:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "upstream_error"
    assert _leaks(answer.text, address) == [], answer.text
    assert address in caplog.text and INTERNAL in caplog.text
