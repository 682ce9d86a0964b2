"""Issue 29, control-plane side: limits on the sequences a key and a tenant have in flight at once.

Through a gateway and a real gRPC worker that holds its answers: a request asking alone for more
than a limit is a 400 naming `n`; one that would go over while others run is a 429
`concurrency_limit_exceeded` (and counted as such); what a request held comes back when it ends,
whether it completed or failed. Then with the holds in a real Redis (127.0.0.1:6379, started by
scripts/test_services.sh): exactly the limit admitted among concurrent requests and between two
limiters or two gateways, and leases that let a crashed gateway's holds expire.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.concurrency import InProcessSequenceLimiter, SequenceLimits
from inferplane.control_plane.errors import ConcurrencyLimited, RequestTooLarge
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.shared_concurrency import RedisSequenceLimiter
from inferplane.control_plane.shared_limits import LimiterUnavailable
from tests.control_plane.fake_worker import RecordingWorker, complete, route_to, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

REDIS_URL = "redis://127.0.0.1:6379/0"





@pytest.fixture
async def worker(tokenizer):
    worker = RecordingWorker(tokenizer)
    server, worker.address = await serve(worker)
    yield worker
    if worker.gate is not None:
        worker.gate.set()
    await server.stop(None)


def _gateway(db: str, **settings) -> Gateway:
    return Gateway(GatewaySettings(db_url=db, **settings))


def _held(gw: Gateway, scope: str, owner: str) -> int:
    return gw.sequences.counter.held(scope, owner)


def _refused(gw: Gateway, tenant: str, key: str) -> float:
    value = gw.context.metrics.registry.get_sample_value(
        "inferplane_key_requests_total", {"tenant": tenant, "key": key, "result": "concurrency_limited"})
    return value or 0.0


async def test_a_keys_limit_refuses_too_many_alone_and_too_many_together(tmp_path, tokenizer, worker) -> None:
    gw = _gateway(f"sqlite:///{tmp_path / 'gw.db'}")
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test")
        created = auth.create_key(s, "t", actor="test", max_concurrent_sequences=3)
    key, key_id = created.secret, created.info.id
    gw.keys.refresh()
    route_to(gw, worker.address, tokenizer)
    try:
        alone = await complete(gw, key, n=4)
        assert alone.status_code == 400, alone.text
        assert (alone.json()["error"]["param"], alone.json()["error"]["code"]) == ("n", "request_too_large")
        assert not worker.requests and _held(gw, "key", key_id) == 0

        worker.gate = asyncio.Event()
        first = asyncio.create_task(complete(gw, key, n=2))
        await worker.wait_for(1)
        assert _held(gw, "key", key_id) == 2
        second = await complete(gw, key, prompt=["a", "b"])  # two prompts × n=1: 2 more would make 4
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert second.json()["error"]["type"] == "rate_limit_error" and second.headers["retry-after"] == "1"
        assert _refused(gw, "t", key_id) == 1
        worker.gate.set()
        assert (await first).status_code == 200
        assert _held(gw, "key", key_id) == 0  # given back once the answer is complete
        assert (await complete(gw, key, n=3)).status_code == 200
    finally:
        gw.engine.dispose()


async def test_a_tenants_limit_holds_for_all_its_keys_together(tmp_path, tokenizer, worker) -> None:
    gw = _gateway(f"sqlite:///{tmp_path / 'gw.db'}")
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test", max_concurrent_sequences=3)
        one = auth.create_key(s, "t", actor="test")
        two = auth.create_key(s, "t", actor="test")
        tenants.create_tenant(s, "other", actor="test", max_concurrent_sequences=3)
        other = auth.create_key(s, "other", actor="test").secret
    gw.keys.refresh()
    route_to(gw, worker.address, tokenizer)
    worker.gate = asyncio.Event()
    try:
        first = asyncio.create_task(complete(gw, one.secret, n=2))
        await worker.wait_for(1)
        refused = await complete(gw, two.secret, n=2)
        assert refused.status_code == 429 and "tenant" in refused.json()["error"]["message"]
        assert _refused(gw, "t", two.info.id) == 1
        # Another tenant is not held back by this one.
        elsewhere = asyncio.create_task(complete(gw, other, n=3))
        await worker.wait_for(2)
        worker.gate.set()
        assert [r.status_code for r in await asyncio.gather(first, elsewhere)] == [200, 200]
        assert (await complete(gw, two.secret, n=3)).status_code == 200
    finally:
        gw.engine.dispose()


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_failed_request_gives_its_sequences_back(tmp_path, tokenizer, worker, when) -> None:
    """The worker fails before its first message or mid-answer (a 503 either way); a model with no
    replica fails before any worker: each time the hold is released."""
    gw = _gateway(f"sqlite:///{tmp_path / 'gw.db'}")
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test", max_concurrent_sequences=3)
        created = auth.create_key(s, "t", actor="test", max_concurrent_sequences=3)
    gw.keys.refresh()
    route_to(gw, worker.address, tokenizer)
    try:
        worker.fail = when
        for _ in range(3):
            failed = await complete(gw, created.secret, n=3)
            assert failed.status_code == 503, failed.text
            assert _held(gw, "key", created.info.id) == 0 and _held(gw, "tenant", "t") == 0
        worker.fail = None
        gw.router.set_route("m", [])  # no replica at all
        for stream in (False, True):
            assert (await complete(gw, created.secret, n=3, stream=stream)).status_code == 503
            assert _held(gw, "key", created.info.id) == 0 and _held(gw, "tenant", "t") == 0
        route_to(gw, worker.address, tokenizer)
        assert (await complete(gw, created.secret, n=3)).status_code == 200
    finally:
        gw.engine.dispose()


async def test_a_request_refused_by_another_limit_holds_nothing(tmp_path, tokenizer, worker) -> None:
    gw = _gateway(f"sqlite:///{tmp_path / 'gw.db'}")
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test")
        created = auth.create_key(s, "t", actor="test", requests_per_minute=1, max_concurrent_sequences=2)
    gw.keys.refresh()
    route_to(gw, worker.address, tokenizer)
    try:
        assert (await complete(gw, created.secret)).status_code == 200
        refused = await complete(gw, created.secret)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert _held(gw, "key", created.info.id) == 0 and _refused(gw, "t", created.info.id) == 0
    finally:
        gw.engine.dispose()


async def test_in_process_limits_admit_exactly_the_limit_among_concurrent_requests() -> None:
    limiter = InProcessSequenceLimiter()
    limits = SequenceLimits(key=5, tenant=7)
    answers = await asyncio.gather(*(limiter.acquire("k", "t", limits, 1) for _ in range(20)),
                                   return_exceptions=True)
    holds = [a for a in answers if not isinstance(a, BaseException)]
    assert len(holds) == 5 and all(isinstance(a, ConcurrencyLimited) for a in answers if a not in holds)
    for hold in holds:
        limiter.release(hold)
        limiter.release(hold)  # a second release gives nothing back twice
    assert limiter.counter.held("key", "k") == 0 and limiter.counter.held("tenant", "t") == 0
    with pytest.raises(RequestTooLarge) as too_many:
        await limiter.acquire("k", "t", SequenceLimits(key=None, tenant=3), 4)
    assert too_many.value.param == "n"
    assert await limiter.acquire("k", "t", SequenceLimits(), 100) is None  # no limit: nothing counted


async def test_two_redis_limiters_admit_the_limit_once_between_them(redis_url) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    first, second = (RedisSequenceLimiter(redis_url, prefix=prefix) for _ in range(2))
    limits = SequenceLimits(key=5, tenant=8)
    try:
        owners = [(first, second)[i % 2] for i in range(20)]
        answers = await asyncio.gather(*(owner.acquire("k", "t", limits, 1) for owner in owners),
                                       return_exceptions=True)
        holds = [(owner, a) for owner, a in zip(owners, answers, strict=True) if not isinstance(a, BaseException)]
        assert len(holds) == 5
        assert all(isinstance(a, ConcurrencyLimited) for a in answers if isinstance(a, BaseException))
        # The tenant's limit counts its other keys' holds too: 5 + 3 = 8.
        other = await second.acquire("k2", "t", limits, 3)
        with pytest.raises(ConcurrencyLimited, match="tenant"):
            await first.acquire("k3", "t", limits, 1)
        for owner, hold in holds[:2]:
            owner.release(hold)
        await first.released()
        await second.released()
        assert await first.acquire("k3", "t", limits, 2) is not None  # room again, seen by both
        with pytest.raises(RequestTooLarge) as too_many:
            await first.acquire("k", "t", limits, 6)
        assert too_many.value.param == "n"
        assert other is not None
    finally:
        await first.close()
        await second.close()


async def test_a_crashed_gateways_holds_expire_and_a_live_ones_do_not(redis_url) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    live, crashed, other = (RedisSequenceLimiter(redis_url, prefix=prefix, lease=0.3) for _ in range(3))
    limits = SequenceLimits(tenant=2)
    try:
        await live.acquire("a", "live", limits, 2)
        await crashed.acquire("b", "gone", limits, 2)
        crashed._renewer.cancel()  # the process died: nobody renews its holds or releases them
        for tenant in ("live", "gone"):
            with pytest.raises(ConcurrencyLimited):
                await other.acquire("c", tenant, limits, 1)
        await asyncio.sleep(0.8)  # over two leases: the live holds were renewed meanwhile
        with pytest.raises(ConcurrencyLimited):
            await other.acquire("c", "live", limits, 1)
        assert await other.acquire("c", "gone", limits, 2) is not None
    finally:
        for limiter in (live, crashed, other):
            await limiter.close()


async def test_an_unreachable_redis_counts_per_replica_or_refuses() -> None:
    """As the rate limits: "open" (the default) falls back to this replica's counts, "closed" is a 503."""
    unreachable = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    limits = SequenceLimits(key=2)
    open_limiter = RedisSequenceLimiter(unreachable)
    closed_limiter = RedisSequenceLimiter(unreachable, failure="closed")
    try:
        hold = await open_limiter.acquire("k", "t", limits, 2)
        with pytest.raises(ConcurrencyLimited):  # the fallback still limits, per replica
            await open_limiter.acquire("k", "t", limits, 1)
        open_limiter.release(hold)
        assert await open_limiter.acquire("k", "t", limits, 2) is not None
        with pytest.raises(LimiterUnavailable):
            await closed_limiter.acquire("k", "t", limits, 1)
    finally:
        await open_limiter.close()
        await closed_limiter.close()


async def test_two_gateways_share_a_limit_through_redis(redis_url, tmp_path, tokenizer, worker) -> None:
    settings = {"rate_limit_redis_url": redis_url}
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    first, second = _gateway(db, **settings), _gateway(db, **settings)
    prefix = f"test:{uuid.uuid4().hex}"
    for gw in (first, second):
        gw.sequences._prefix = prefix  # this test's own holds in the shared Redis
    with first.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test")
        key = auth.create_key(s, "t", actor="test", max_concurrent_sequences=3).secret
    for gw in (first, second):
        gw.keys.refresh()
        route_to(gw, worker.address, tokenizer)
    worker.gate = asyncio.Event()
    try:
        held = asyncio.create_task(complete(first, key, n=2))
        await worker.wait_for(1)
        refused = await complete(second, key, n=2)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        worker.gate.set()
        assert (await held).status_code == 200
        await first.sequences.released()
        worker.gate = None
        assert (await complete(second, key, n=3)).status_code == 200
    finally:
        for gw in (first, second):
            await gw.sequences.close()
            await gw.limiter.close()
            gw.engine.dispose()
