"""The inference fast path answers bad requests exactly as the FastAPI routes it stands in for.

Both apps share one GatewayContext (SQLite, a real key cache); every case here fails before a
worker would be needed: bad JSON, wrong content type, no or bad key, missing scope, invalid
fields, unknown model.
"""

from __future__ import annotations

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.rest import create_app, create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

COMPLETION = b'{"model": "m", "prompt": "hi", "max_tokens": 1}'
CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def gateway(tmp_path):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t1", actor="test")
        gw.infer_key = auth.create_key(session, "t1", actor="test").secret
        gw.read_key = auth.create_key(session, "t1", actor="test", scopes=["models:read"]).secret
    gw.keys.refresh()
    yield gw
    gw.engine.dispose()


def _cases(gw) -> list[tuple[str, dict, bytes | None]]:
    json_type = {"content-type": "application/json"}
    good = {**json_type, "authorization": f"Bearer {gw.infer_key}"}
    return [
        ("not JSON", good, b"{not json"),
        ("not UTF-8", good, b"\xff\xfe{}"),
        ("no content type", {"authorization": good["authorization"]}, None),
        ("text content type", {**good, "content-type": "text/plain"}, None),
        ("json with charset", {**good, "content-type": "application/json; charset=utf-8"}, b'{"model": 1}'),
        ("empty body", good, b""),
        ("array body", good, b"[1, 2]"),
        ("no key", json_type, None),
        ("malformed key", {**json_type, "authorization": "Bearer nope"}, None),
        ("unknown key", {**json_type, "authorization": "Bearer ip_0000000000000000_" + "x" * 43}, None),
        ("key without infer scope", {**json_type, "authorization": f"Bearer {gw.read_key}"}, None),
        ("missing field", good, b'{"model": "m"}'),
        ("wrong type", good, b'{"model": "m", "prompt": "hi", "messages": [], "max_tokens": "many"}'),
        ("out of range", good, b'{"model": "m", "prompt": "hi", "messages": [{"role": "user"}], "n": 3}'),
        ("unknown model", good, None),
    ]


async def _answer(app, path: str, headers: dict, body: bytes) -> tuple[int, dict]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
        response = await client.post(path, content=body, headers=headers)
    return response.status_code, response.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_requests_get_the_same_answer_from_both(gateway, path):
    fast, plain = create_asgi_app(gateway.context), create_app(gateway.context)
    default = COMPLETION if path == "/v1/completions" else CHAT
    statuses = set()
    for name, headers, body in _cases(gateway):
        body = default if body is None else body
        got, expected = await _answer(fast, path, headers, body), await _answer(plain, path, headers, body)
        assert got == expected, name
        assert got[0] >= 400 and got[1]["error"]["message"], name
        statuses.add(got[0])
    assert statuses == {400, 401, 403, 404}  # OpenAI's 400 for invalid bodies, not FastAPI's 422


async def test_a_chunked_body_over_the_limit_gets_413(gateway):
    gateway.context.max_body_bytes = 1000

    async def chunks():
        for _ in range(10):
            yield b" " * 200  # no Content-Length: only counting what arrives can catch it

    app = create_asgi_app(gateway.context)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
        response = await client.post("/v1/completions", content=chunks(),
                                     headers={"authorization": f"Bearer {gateway.infer_key}"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
