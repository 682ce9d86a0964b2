"""Issue 13, item 8: a queued streaming request gets its headers at once, then SSE keep-alives.

Before, the gateway sent no response headers until the first token, so a client with a read timeout
gave up while its request was queued. Now a stream still waiting after HEADER_WAIT gets its headers,
a `: queued` comment, and a comment every KEEPALIVE_INTERVAL until tokens flow; a failure in the
first moments (no replica) is still a proper HTTP status.
"""

from __future__ import annotations

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway import completions
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.routing import Deployment, StaticEndpointSource

pytestmark = pytest.mark.slow


def tenant_key(gw) -> str:
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t", actor="test")
        key = auth.create_key(session, "t", actor="test").secret
    gw.keys.refresh()
    return key


async def stream_lines(gw, key: str, model: str = "m") -> tuple[int, list[str]]:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=300) as client:
        answer = await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"model": model, "prompt": "a", "max_tokens": 8, "stream": True})
    return answer.status_code, [line for line in answer.text.split("\n") if line]


async def test_a_stream_not_started_in_time_sends_headers_and_keepalives_first(in_process_gateway, monkeypatch):
    monkeypatch.setattr(completions, "HEADER_WAIT", 0.0)  # every stream counts as queued
    monkeypatch.setattr(completions, "KEEPALIVE_INTERVAL", 0.001)
    status, lines = await stream_lines(in_process_gateway, tenant_key(in_process_gateway))
    assert status == 200 and lines[0] == ": queued", lines
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data: ")]
    assert lines.index(data[0]) == len(comments)  # the comments all come before the first token
    assert data[-1] == "data: [DONE]" and len(data) >= 3, lines


async def test_a_stream_that_fails_at_once_still_gets_its_http_status(in_process_gateway):
    in_process_gateway.router.set_route("m", [Deployment("d", StaticEndpointSource([]))])  # no replica
    status, lines = await stream_lines(in_process_gateway, tenant_key(in_process_gateway))
    assert status == 503 and "no_replica_available" in lines[0], lines
