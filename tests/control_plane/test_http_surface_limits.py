"""Issue 29, items 4 and 6: the HTTP surface is bounded before anyone is trusted.

Before this, a chunked POST (no Content-Length) to any FastAPI route was read whole before the 401,
so one unauthenticated request could make the gateway buffer 200 MB; admin bodies stored strings of
any length (a 50 MB key name, a 10 MB display name) and took `true` or `"5"` for integers;
`OPTIONS /admin/v1/models/resolve` advertised DELETE; and a `pvc://claim/../../etc/passwd` source
was registered and served by `/models/resolve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.admin_types import (
    DISPLAY_NAME_MAX_LENGTH,
    KEY_NAME_MAX_LENGTH,
    MODEL_NAME_MAX_LENGTH,
    MODEL_SOURCE_MAX_LENGTH,
    MODEL_VERSION_MAX_LENGTH,
    SCOPE_MAX_LENGTH,
    SCOPES_MAX_ITEMS,
    TENANT_ID_MAX_LENGTH,
)
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

BOOTSTRAP = "bootstrap-admin-key-for-tests"
WEBHOOK_SECRET = "alertmanager-shared-secret"
LIMIT = 64 * 1024  # the gateway's body limit in these tests: small, so an unbounded read is obvious
CHUNK = 16 * 1024
HUGE = 200 * 1024 * 1024  # what the client offers to send: far more than anyone should buffer
SOCKET_HUGE = 32 * 1024 * 1024  # the same over a real socket: 512 times the limit, sent in a few seconds


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=BOOTSTRAP,
                                 alert_webhook_secret=WEBHOOK_SECRET))
    gw.context.max_body_bytes = LIMIT
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t1", actor="test")
        gw.tenant_admin_key = auth.create_key(session, "t1", actor="test", scopes=["infer", "admin"]).secret
    gw.keys.refresh()
    yield gw
    gw.engine.dispose()


async def _request(gw: Gateway, method: str, path: str, body: Any = None, key: str | None = BOOTSTRAP
                   ) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    transport = httpx.ASGITransport(create_asgi_app(gw.context), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.request(method, path, headers=headers,
                                    content=None if body is None else json.dumps(body))


# -- item 4: bodies are bounded on every route, chunked or not, before authentication ---------------


class _Client:
    """The client side of one ASGI request: offers `HUGE` bytes in chunks, counting what the app pulls,
    and records what it sends back. Calling the app directly counts exactly what was read; a real
    server would hide that behind its socket buffers."""

    def __init__(self) -> None:
        self.pulled = 0
        self.messages: list[dict] = []

    async def receive(self) -> dict:
        if self.pulled >= HUGE:
            return {"type": "http.disconnect"}
        self.pulled += CHUNK
        return {"type": "http.request", "body": b"x" * CHUNK, "more_body": self.pulled < HUGE}

    async def send(self, message: dict) -> None:
        self.messages.append(message)


@pytest.mark.parametrize(("path", "credential"), [
    ("/admin/v1/tenants", None),  # FastAPI reads a declared body before its dependencies check the key
    ("/admin/v1/keys", "ip_wrong"),
    ("/alerts/v1/webhook", WEBHOOK_SECRET),  # a route that reads `request.body()` itself
    ("/v1/completions", None),  # the fast path: the same mechanism, not a second count
])
async def test_a_chunked_body_over_the_limit_is_refused_without_reading_the_rest(gateway: Gateway, path: str,
                                                                                credential: str | None) -> None:
    headers = [(b"content-type", b"application/json")]
    if credential:
        headers.append((b"authorization", f"Bearer {credential}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("gw", 80)}
    client = _Client()
    await create_asgi_app(gateway.context)(scope, client.receive, client.send)
    starts = [m for m in client.messages if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [413], client.messages  # one answer, the 413, not the 401
    body = json.loads(b"".join(m.get("body", b"") for m in client.messages if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "request_too_large", body
    assert client.pulled <= LIMIT + CHUNK  # nothing read past the chunk that crossed the limit


@pytest.fixture
async def served(gateway: Gateway) -> AsyncIterator[int]:
    """The gateway's ASGI app behind a real uvicorn server on a loopback port: the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_asgi_app(gateway.context), log_level="warning",
                                           lifespan="off", access_log=False))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    await task
    sock.close()


async def test_a_real_server_answers_413_while_the_chunked_body_is_still_coming(served: int) -> None:
    """Over a socket: the 413 arrives while the client is still sending, after a fraction of the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    writer.write(b"POST /admin/v1/tenants HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (CHUNK, b" " * CHUNK)
    sent = 0  # body bytes written so far

    async def send_body() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):  # the server closed the connection after its answer
            while sent < SOCKET_HUGE:
                writer.write(chunk)
                sent += CHUNK
                await writer.drain()
            writer.write(b"0\r\n\r\n")  # the end of the body: a server that buffered it all answers now
            await writer.drain()

    sender = asyncio.create_task(send_body())
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        sent_before_the_answer = sent
    finally:
        sender.cancel()
        writer.close()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
            await writer.wait_closed()
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert b"\r\nconnection: close\r\n" in head.lower(), head  # so the server reads none of the rest
    # Had the server buffered the body before answering, the client would have sent all of it.
    assert sent_before_the_answer < SOCKET_HUGE // 4, sent_before_the_answer


# -- item 6: admin strings have maximum lengths, admin integers are strict ----------------------------


TOO_LONG = [
    ("POST", "/admin/v1/tenants", {"id": "t" * (TENANT_ID_MAX_LENGTH + 1)}, "id"),
    ("POST", "/admin/v1/tenants", {"id": "t2", "display_name": "d" * (DISPLAY_NAME_MAX_LENGTH + 1)}, "display_name"),
    ("POST", "/admin/v1/keys", {"tenant_id": "t1", "name": "n" * (KEY_NAME_MAX_LENGTH + 1)}, "name"),
    ("POST", "/admin/v1/keys", {"tenant_id": "t1", "scopes": ["s" * (SCOPE_MAX_LENGTH + 1)]}, "scopes.0"),
    ("POST", "/admin/v1/keys", {"tenant_id": "t1", "scopes": ["infer"] * (SCOPES_MAX_ITEMS + 1)}, "scopes"),
    ("POST", "/admin/v1/models", {"source": "/" + "s" * MODEL_SOURCE_MAX_LENGTH}, "source"),
    ("POST", "/admin/v1/models", {"source": "smollm2-135m", "name": "n" * (MODEL_NAME_MAX_LENGTH + 1)}, "name"),
    ("POST", "/admin/v1/models", {"source": "smollm2-135m", "version": "v" * (MODEL_VERSION_MAX_LENGTH + 1)},
     "version"),
    ("POST", "/admin/v1/models", {"source": "smollm2-135m", "sha256": "a" * 65}, "sha256"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), TOO_LONG)
async def test_admin_strings_over_their_maximum_length_are_refused_naming_the_field(
        gateway: Gateway, method: str, path: str, body: dict, field: str) -> None:
    reply = await _request(gateway, method, path, body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == field, reply.json()
    assert len(reply.text) < 2000  # the answer does not echo the long value back


async def test_a_webhook_url_over_its_maximum_length_is_refused_by_the_body_model(gateway: Gateway) -> None:
    """The webhook's validators already refused it (same 422 naming `url`); the body model now refuses
    it before the route runs, with the same limit (one constant)."""
    from inferplane.control_plane.alerts.webhooks import MAX_URL_LENGTH, SECRET_MAX_LENGTH

    url = "https://hooks.example.com/" + "u" * MAX_URL_LENGTH
    reply = await _request(gateway, "PUT", "/admin/v1/tenants/t1/webhooks", {"url": url})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "url", reply.text
    reply = await _request(gateway, "PUT", "/admin/v1/tenants/t1/webhooks",
                           {"url": "https://hooks.example.com/x", "secret": "s" * (SECRET_MAX_LENGTH + 1)})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "secret", reply.text


async def test_admin_strings_at_their_maximum_length_are_stored(gateway: Gateway) -> None:
    reply = await _request(gateway, "POST", "/admin/v1/tenants",
                           {"id": "t2", "display_name": "d" * DISPLAY_NAME_MAX_LENGTH})
    assert reply.status_code == 201, reply.text
    reply = await _request(gateway, "POST", "/admin/v1/keys", {"tenant_id": "t2", "name": "n" * KEY_NAME_MAX_LENGTH})
    assert reply.status_code == 201 and reply.json()["name"] == "n" * KEY_NAME_MAX_LENGTH, reply.text


NOT_STRICTLY_INTEGERS = [
    ("POST", "/admin/v1/tenants", {"id": "t2", "monthly_token_quota": True}, "monthly_token_quota"),
    ("POST", "/admin/v1/tenants", {"id": "t2", "monthly_token_quota": "5"}, "monthly_token_quota"),
    ("POST", "/admin/v1/tenants", {"id": "t2", "key_tokens_per_minute_max": 5.0}, "key_tokens_per_minute_max"),
    ("PATCH", "/admin/v1/tenants/t1", {"key_requests_per_minute_max": "5"}, "key_requests_per_minute_max"),
    ("PATCH", "/admin/v1/tenants/t1", {"monthly_token_quota": True}, "monthly_token_quota"),
    ("POST", "/admin/v1/keys", {"tenant_id": "t1", "expires_in_seconds": "60"}, "expires_in_seconds"),
    ("POST", "/admin/v1/keys", {"tenant_id": "t1", "requests_per_minute": True}, "requests_per_minute"),
    ("POST", "/admin/v1/keys", {"tenant_id": "t1", "tokens_per_minute": "100"}, "tokens_per_minute"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), NOT_STRICTLY_INTEGERS)
async def test_admin_integers_are_strict(gateway: Gateway, method: str, path: str, body: dict, field: str) -> None:
    """`true` is not 1 and `"5"` is not 5, as on the OpenAI bodies: a client sending them has a bug
    worth hearing about, not a quota silently set to 1."""
    reply = await _request(gateway, method, path, body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == field, reply.json()


async def test_admin_integers_sent_as_integers_are_taken(gateway: Gateway) -> None:
    reply = await _request(gateway, "POST", "/admin/v1/tenants", {"id": "t2", "monthly_token_quota": 5})
    assert reply.status_code == 201 and reply.json()["monthly_token_quota"] == 5, reply.text


# -- the model registry's admin paths -----------------------------------------------------------------


async def test_options_on_models_resolve_lists_only_what_the_path_serves(gateway: Gateway) -> None:
    """`/admin/v1/models/{ref:path}` (DELETE) used to match `resolve` too, so the Allow header said
    DELETE, and a DELETE there would have gone to a model named "resolve"."""
    reply = await _request(gateway, "OPTIONS", "/admin/v1/models/resolve")
    assert reply.status_code == 405 and reply.headers["allow"] == "GET", reply.headers
    reply = await _request(gateway, "DELETE", "/admin/v1/models/resolve")
    assert reply.status_code == 405 and reply.headers["allow"] == "GET", reply.text
    reply = await _request(gateway, "OPTIONS", "/admin/v1/models/some-model")
    assert reply.status_code == 405 and reply.headers["allow"] == "DELETE", reply.headers


async def test_delete_still_takes_model_references_with_slashes(gateway: Gateway) -> None:
    """The route's new path convertor keeps what `{ref:path}` matched, `resolve` aside."""
    body = {"source": "pvc://claim/m.gguf", "name": "org/resolve", "sha256": "a" * 64, "format": "gguf"}
    assert (await _request(gateway, "POST", "/admin/v1/models", body)).status_code == 201
    reply = await _request(gateway, "DELETE", "/admin/v1/models/org/resolve:1")
    assert reply.status_code == 200 and reply.json()["deleted"] == ["org/resolve:1"], reply.text


async def test_the_name_resolve_cannot_be_registered(gateway: Gateway) -> None:
    """Such a model could never be deleted by name: its path is the resolve endpoint's."""
    body = {"source": "pvc://claim/m.gguf", "name": "resolve", "sha256": "a" * 64, "format": "gguf"}
    reply = await _request(gateway, "POST", "/admin/v1/models", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "name", reply.text


@pytest.mark.parametrize("source", [
    "pvc://claim/../../etc/passwd",
    "pvc://claim/models/../../../etc/passwd",
    "pvc://claim/./m.gguf",
    "pvc://claim/%2e%2e/etc/passwd",  # the worker takes the path literally; refused all the same
    "pvc://claim/m%2f..%2f..%2fetc/passwd",
    "pvc://claim/m.gguf\x00",
])
async def test_a_pvc_source_escaping_its_claim_is_refused_naming_source(gateway: Gateway, source: str) -> None:
    body = {"source": source, "name": "escape", "sha256": "a" * 64, "format": "gguf"}
    reply = await _request(gateway, "POST", "/admin/v1/models", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "source", reply.json()
    resolved = await _request(gateway, "GET", "/admin/v1/models/resolve?name=escape")
    assert resolved.status_code == 404, resolved.text  # nothing was stored, nothing is served


async def test_a_pvc_source_inside_its_claim_is_registered_and_resolved(gateway: Gateway) -> None:
    body = {"source": "pvc://claim/models/m.gguf", "name": "inside", "sha256": "a" * 64, "format": "gguf"}
    assert (await _request(gateway, "POST", "/admin/v1/models", body)).status_code == 201
    resolved = await _request(gateway, "GET", "/admin/v1/models/resolve?name=inside")
    assert resolved.status_code == 200 and resolved.json()["uri"] == "pvc://claim/models/m.gguf", resolved.text
