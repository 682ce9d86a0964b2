"""Issue 13's attacks that need no worker: hostile input gets a 4xx naming what is wrong, never a
500 (item 6), and a request nobody served is not billed (item 7).

Each bad-input case was a 500 before: a body nested 100,000 deep was parsed before the key was checked (and
overflowed the parser's recursion), a lone UTF-16 surrogate or an integer beyond the wire types
reached the worker request, an admin integer beyond 64 bits reached the database.
"""

from __future__ import annotations

import json

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def gateway(tmp_path):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t1", actor="test")
        gw.infer_key = auth.create_key(session, "t1", actor="test", scopes=["infer", "admin"]).secret
    gw.keys.refresh()
    yield gw
    gw.engine.dispose()


async def _post(gw, path: str, body: str, key: str | None) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    transport = httpx.ASGITransport(create_asgi_app(gw.context), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post(path, content=body, headers=headers)
    return response.status_code, response.json()


async def test_a_deeply_nested_body_is_not_parsed_for_an_unknown_caller(gateway):
    assert (await _post(gateway, "/v1/completions", DEEP, None))[0] == 401
    status, body = await _post(gateway, "/v1/completions", DEEP, gateway.infer_key)
    assert status == 400 and body["error"]["message"] == "request body is nested too deeply"
    # The admin API (FastAPI parses before its key check): still a 400, not a 500.
    assert (await _post(gateway, "/admin/v1/tenants", DEEP, None))[0] == 400


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"model": "m", "prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stop": ["ok", "\udfff"]}, "stop.1"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a\ud83d"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text"),
])
async def test_strings_that_are_not_unicode_are_refused_naming_them(gateway, path, body, field):
    status, answer = await _post(gateway, path, json.dumps(body), gateway.infer_key)  # json escapes them
    assert status == 400, answer
    assert f"{field}: not valid Unicode text" in answer["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**31), ("seed", 2**64), ("max_tokens", 2**32), ("top_k", 10**40),
])
async def test_integers_beyond_the_wire_types_are_refused(gateway, field, value):
    body = {"model": "m", "prompt": "hi", field: value}
    status, answer = await _post(gateway, "/v1/completions", json.dumps(body), gateway.infer_key)
    assert status == 400 and answer["error"]["param"] == field, answer


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/admin/v1/keys", {"tenant_id": "t1", "requests_per_minute": 2**70}, "requests_per_minute"),
    ("/admin/v1/keys", {"tenant_id": "t1", "tokens_per_minute": 2**64}, "tokens_per_minute"),
    ("/admin/v1/keys", {"tenant_id": "t1", "expires_in_seconds": 2**63}, "expires_in_seconds"),
    ("/admin/v1/tenants", {"id": "t2", "monthly_token_quota": 2**70}, "monthly_token_quota"),
])
async def test_admin_integers_beyond_64_bits_are_refused(gateway, path, body, field):
    status, answer = await _post(gateway, path, json.dumps(body), gateway.infer_key)
    assert status == 422 and answer["error"]["param"] == field, answer


async def test_a_request_no_replica_served_is_not_billed(gateway, tmp_path):
    """Issue 13, item 7: a 503 no_replica_available used to count a request and its prompt tokens."""
    from inferplane.bench.tiny_model import make_tiny_model
    from inferplane.control_plane.gateway.catalog import ServedModel
    from inferplane.control_plane.routing import Deployment, StaticEndpointSource
    from inferplane.worker.model.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(make_tiny_model(tmp_path / "tiny"))
    gateway.catalog.put(ServedModel(name="m", tokenizer=tokenizer, max_model_len=256))
    gateway.router.set_route("m", [Deployment("team-a/m", StaticEndpointSource([]))])  # no replica
    status, answer = await _post(gateway, "/v1/completions", json.dumps({"model": "m", "prompt": "hi"}),
                                 gateway.infer_key)
    assert status == 503 and answer["error"]["code"] == "no_replica_available", answer
    gateway.usage.flush()
    transport = httpx.ASGITransport(create_asgi_app(gateway.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        usage = (await client.get("/v1/usage", headers={"authorization": f"Bearer {gateway.infer_key}"})).json()
    assert usage["totals"]["requests"] == 0 and usage["totals"]["prompt_tokens"] == 0, usage


@pytest.mark.parametrize(("params", "field"), [
    ({"temperature": float("nan")}, "temperature"),
    ({"stop": ["x"] * 100_000}, "stop"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop_token_ids": list(range(1000))}, "params.stop_token_ids"),
])
async def test_the_grpc_api_validates_like_rest(gateway, params, field):
    """Issue 13, item 8: the tenant gRPC API skipped the REST validation (NaN temperature, a huge
    stop list slowed every tenant); it now goes through the same pydantic models, before any model lookup."""
    import grpc

    from inferplane.control_plane.gateway.grpc_api import InferenceServicer
    from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(gateway.context), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.CompleteRequest(model="m", prompt="hi",
                                                    params=worker_pb2.SamplingParams(max_tokens=4, **params))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Complete(request, metadata=[("authorization", f"Bearer {gateway.infer_key}")],
                                             timeout=30):
                    pass
    finally:
        await server.stop(None)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert caught.value.details().startswith(f"{field}"), caught.value.details()


async def test_405_names_every_method_the_path_takes(gateway):
    transport = httpx.ASGITransport(create_asgi_app(gateway.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.get("/v1/completions")).headers["allow"] == "POST"
        assert (await client.get("/alerts/v1/webhook")).headers["allow"] == "POST"  # a route of an included router
        reply = await client.put("/admin/v1/tenants")
    assert reply.status_code == 405 and reply.headers["allow"] == "GET, POST"
    assert reply.json()["error"]["message"] == "Method Not Allowed"


async def test_a_write_the_database_refuses_is_a_503_not_a_500(gateway):
    """A read-only database (a PostgreSQL standby, a read-only SQLite file) is an outage to retry."""
    from sqlalchemy import event

    gateway.engine.dispose()
    event.listen(gateway.engine, "connect", lambda dbapi, _record: dbapi.execute("PRAGMA query_only = ON"))
    status, answer = await _post(gateway, "/admin/v1/keys", json.dumps({"tenant_id": "t1"}), gateway.infer_key)
    assert status == 503 and answer["error"]["code"] == "database_unavailable", answer
