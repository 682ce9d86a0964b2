"""Issue 13, item 3: a key's limits hold across gateway replicas, with the buckets in a real Redis.

Two gateways share one database and one Redis (127.0.0.1:6379, started by scripts/test_services.sh);
before, each kept its own buckets and two replicas admitted twice a key's requests per minute.
Also: token reservations across replicas, refunds, and both answers to an unreachable Redis.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.errors import RateLimited
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.limits import KeyLimits
from inferplane.control_plane.shared_limits import LimiterUnavailable, RedisKeyLimiter

REDIS_URL = "redis://127.0.0.1:6379/0"
UNREACHABLE = "redis://127.0.0.1:1/0"  # nothing listens on port 1




def serve_without_replicas(gw: Gateway, tokenizer) -> None:
    """A served model with no replica: an admitted request gets 503 no_replica_available, a refused one 429."""
    from inferplane.control_plane.gateway.catalog import ServedModel
    from inferplane.control_plane.routing import Deployment, StaticEndpointSource

    gw.catalog.put(ServedModel(name="m", tokenizer=tokenizer, max_model_len=256))
    gw.router.set_route("m", [Deployment("d", StaticEndpointSource([]))])


def limiter(url: str, prefix: str, **kw) -> RedisKeyLimiter:
    return RedisKeyLimiter(url, prefix=prefix, **kw)


async def test_two_gateways_admit_a_keys_requests_per_minute_once_between_them(redis_url, tokenizer, tmp_path):
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    settings = GatewaySettings(db_url=db, rate_limit_redis_url=redis_url)
    first, second = Gateway(settings), Gateway(settings)
    prefix = f"test:{uuid.uuid4().hex}"
    for gw in (first, second):
        gw.limiter._prefix = prefix  # this test's own buckets in the shared Redis
    with first.sessions.begin() as session:
        tenants.create_tenant(session, "t", actor="test")
        key = auth.create_key(session, "t", actor="test", requests_per_minute=10).secret
    statuses = []
    try:
        for gw in (first, second):
            gw.keys.refresh()
            serve_without_replicas(gw, tokenizer)
        for i in range(30):
            gw = (first, second)[i % 2]
            transport = httpx.ASGITransport(create_asgi_app(gw.context))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                answer = await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                           json={"model": "m", "prompt": "hi"})
            statuses.append(answer.status_code)
    finally:
        for gw in (first, second):
            await gw.limiter.close()
            gw.engine.dispose()
    assert set(statuses) == {503, 429}, statuses
    assert statuses.count(503) in (10, 11), statuses  # the key's 10 (+1 if a refill landed meanwhile)


async def test_token_reservations_are_shared_and_refunds_return(redis_url):
    prefix = f"test:{uuid.uuid4().hex}"
    replicas = [limiter(redis_url, prefix), limiter(redis_url, prefix)]
    limits = KeyLimits(tokens_per_minute=60)
    try:
        async def admit(i: int) -> bool:
            try:
                await replicas[i % 2].admit("key", limits, tokens=31)
                return True
            except RateLimited:
                return False

        admitted = await asyncio.gather(*(admit(i) for i in range(20)))
        assert sum(admitted) == 1  # 60 // 31, whichever replica got there first
        await replicas[1].adjust("key", limits, -30)  # it used 1 of its 31: the rest goes back
        await replicas[0].admit("key", limits, tokens=31)
    finally:
        for replica in replicas:
            await replica.close()


async def test_unreachable_redis_fails_open_to_per_replica_buckets():
    open_limiter = limiter(UNREACHABLE, "x", failure="open", timeout=0.2)
    limits = KeyLimits(requests_per_minute=2)
    await open_limiter.admit("key", limits, tokens=0)
    await open_limiter.admit("key", limits, tokens=0)
    with pytest.raises(RateLimited):  # the fallback still limits, per replica
        await open_limiter.admit("key", limits, tokens=0)
    await open_limiter.close()


async def test_unreachable_redis_fails_closed_with_a_503(tokenizer, tmp_path):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", rate_limit_redis_url=UNREACHABLE,
                                 rate_limit_unreachable="closed"))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t", actor="test")
        key = auth.create_key(session, "t", actor="test", requests_per_minute=10).secret
    gw.keys.refresh()
    serve_without_replicas(gw, tokenizer)
    with pytest.raises(LimiterUnavailable):
        await gw.limiter.admit("k", KeyLimits(requests_per_minute=1), tokens=0)
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        answer = await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"model": "m", "prompt": "hi"})
    await gw.limiter.close()
    gw.engine.dispose()
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "rate_limiter_unavailable", answer.text
