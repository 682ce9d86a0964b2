"""Retry policy: failures before the first message move the request, failures after never do."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest

from inferplane.control_plane.routing import (
    Deployment,
    Endpoint,
    NoReplicaAvailable,
    Router,
    RouteRequest,
    StaticEndpointSource,
    StreamBrokenAfterStart,
    is_retryable,
    route_and_stream,
)

ADDRS = [f"10.0.0.{i}:50051" for i in range(4)]


class WorkerDown(ConnectionError):
    pass


class FakeWorkers:
    """``call`` for route_and_stream: each address either serves, dies before its first message, or
    dies after ``break_after`` messages. Records every attempt."""

    def __init__(self, dead: set[str] = frozenset(), break_after: dict[str, int] | None = None) -> None:  # type: ignore[assignment]
        self.dead = set(dead)
        self.break_after = break_after or {}
        self.attempts: list[str] = []
        self.closed: list[str] = []

    def __call__(self, ep: Endpoint) -> AsyncIterator[str]:
        self.attempts.append(ep.address)
        return self._stream(ep.address)

    async def _stream(self, address: str) -> AsyncIterator[str]:
        try:
            await asyncio.sleep(0)
            if address in self.dead:
                raise WorkerDown(address)
            for i in range(3):
                if self.break_after.get(address) == i:
                    raise WorkerDown(address)
                yield f"{address}:{i}"
                await asyncio.sleep(0)
        finally:
            self.closed.append(address)


def _router(n: int = 4) -> Router:
    return Router({"m": [Deployment("d", StaticEndpointSource(ADDRS[:n]), block_size=4)]},
                  rng=random.Random(0))


def _req(seed: int) -> RouteRequest:
    rnd = random.Random(seed)
    return RouteRequest("m", token_ids=[rnd.randrange(1000) for _ in range(12)])


async def _collect(router: Router, req: RouteRequest, workers: FakeWorkers, **kw: object) -> list[str]:
    return [m async for m in route_and_stream(router, req, workers, **kw)]  # type: ignore[arg-type]


async def test_killed_worker_loses_no_unstarted_request() -> None:
    router = _router()
    dead = ADDRS[1]
    workers = FakeWorkers(dead={dead})

    async def one(seed: int) -> list[str]:
        return await _collect(router, _req(seed), workers)

    results = await asyncio.gather(*(one(s) for s in range(200)))
    assert all(len(r) == 3 and not r[0].startswith(dead) for r in results)  # every request completed
    assert workers.attempts.count(dead) >= 1  # it was routed to, failed, and the requests moved
    assert not router.health.is_healthy(dead)  # ...and it was ejected after a run of failures
    assert sum(router.load.outstanding(a) for a in ADDRS) == 0  # every lease was released
    assert sorted(Counter(workers.closed).elements()) == sorted(workers.attempts)


async def test_retry_never_revisits_a_replica_and_gives_up_typed() -> None:
    router = _router(3)
    workers = FakeWorkers(dead=set(ADDRS[:3]))
    with pytest.raises(NoReplicaAvailable) as info:
        await _collect(router, _req(1), workers, max_attempts=5)
    assert sorted(workers.attempts) == sorted(ADDRS[:3])  # each tried once, then nothing left
    assert isinstance(info.value.__cause__, WorkerDown)
    workers2 = FakeWorkers(dead=set(ADDRS[:3]))
    with pytest.raises(NoReplicaAvailable):
        await _collect(_router(3), _req(1), workers2, max_attempts=2)
    assert len(workers2.attempts) == 2


async def test_failure_after_first_message_is_not_retried() -> None:
    router = _router(1)
    workers = FakeWorkers(break_after={ADDRS[0]: 1})
    got: list[str] = []
    with pytest.raises(StreamBrokenAfterStart) as info:
        async for msg in route_and_stream(router, _req(2), workers):
            got.append(msg)
    assert got == [f"{ADDRS[0]}:0"]
    assert workers.attempts == [ADDRS[0]]  # no second attempt
    assert info.value.endpoint == ADDRS[0] and info.value.items_sent == 1
    assert isinstance(info.value.__cause__, WorkerDown)
    assert router.load.outstanding(ADDRS[0]) == 0


async def test_mixed_failures_over_many_requests() -> None:
    router = _router()
    workers = FakeWorkers(dead={ADDRS[0]}, break_after={ADDRS[3]: 2})
    done = broken = 0
    for s in range(100):
        try:
            out = await _collect(router, _req(s), workers)
        except StreamBrokenAfterStart as exc:
            assert exc.endpoint == ADDRS[3]
            broken += 1
        else:
            assert len(out) == 3
            done += 1
    assert done + broken == 100 and broken > 0 and done > 0


async def test_non_retryable_errors_pass_through_without_blame() -> None:
    router = _router(2)

    class BadRequest(Exception):
        pass

    async def call(ep: Endpoint) -> AsyncIterator[str]:
        raise BadRequest("prompt too long")
        yield ""  # pragma: no cover

    for _ in range(5):
        with pytest.raises(BadRequest):
            await _collect(router, _req(3), call)  # type: ignore[arg-type]
    assert all(router.health.is_healthy(a) for a in ADDRS[:2])


async def test_call_that_fails_to_open_is_retried() -> None:
    router = _router(2)
    seen: list[str] = []

    def call(ep: Endpoint) -> AsyncIterator[str]:
        seen.append(ep.address)
        if len(seen) == 1:
            raise WorkerDown("connect refused")
        return FakeWorkers()(ep)

    assert len(await _collect(router, _req(4), call)) == 3  # type: ignore[arg-type]
    assert len(set(seen)) == 2


async def test_client_disconnect_closes_the_worker_stream_and_frees_the_lease() -> None:
    router = _router(1)
    workers = FakeWorkers()
    gen = route_and_stream(router, _req(5), workers)
    assert (await anext(gen)).endswith(":0")
    assert router.load.outstanding(ADDRS[0]) == 1
    await gen.aclose()
    assert router.load.outstanding(ADDRS[0]) == 0 and workers.closed == [ADDRS[0]]
    assert router.health.is_healthy(ADDRS[0])


def test_retryable_classification() -> None:
    def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata())

    assert is_retryable(rpc_error(grpc.StatusCode.UNAVAILABLE))
    assert is_retryable(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert not is_retryable(rpc_error(grpc.StatusCode.INVALID_ARGUMENT))
    assert not is_retryable(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert is_retryable(ConnectionResetError())
    assert not is_retryable(ValueError())
