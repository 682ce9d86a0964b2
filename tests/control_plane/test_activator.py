"""The activator: requests for a model at zero replicas wait (bounded) for one; a spillover tier with
replicas serves them meanwhile instead."""

from __future__ import annotations

import asyncio

import pytest

from inferplane.control_plane.autoscale.activator import Activator, HoldPolicy
from inferplane.control_plane.errors import ServiceUnavailable
from inferplane.control_plane.gateway.errors import as_error
from inferplane.control_plane.routing import Deployment, Router, StaticEndpointSource, Tier


def routes(primary: StaticEndpointSource, spillover: StaticEndpointSource | None = None) -> Router:
    router = Router()
    deployments = [Deployment("gpu", primary)]
    if spillover is not None:
        deployments.append(Deployment("cpu", spillover, tier=Tier.SPILLOVER))
    router.set_route("m", deployments)
    return router


async def test_a_held_request_proceeds_once_a_replica_is_ready():
    primary = StaticEndpointSource([])
    router, activator = routes(primary), Activator(poll_interval=0.01)
    activator.configure("m", HoldPolicy(queue_size=2, timeout=60))
    waiting = asyncio.create_task(activator.wait_for_replica("m", lambda: router.has_replicas("m")))
    await asyncio.sleep(0.05)
    assert not waiting.done() and activator.held("m") == 1  # the autoscaler sees it as load
    primary.add("10.0.0.1:50051")
    await asyncio.wait_for(waiting, 5)
    assert activator.held("m") == 0


async def test_a_spillover_with_replicas_takes_the_requests_instead():
    router = routes(StaticEndpointSource([]), StaticEndpointSource(["10.0.0.2:50051"]))
    activator = Activator()
    activator.configure("m", HoldPolicy(queue_size=2, timeout=60))
    await asyncio.wait_for(activator.wait_for_replica("m", lambda: router.has_replicas("m")), 1)
    assert activator.held("m") == 0


async def test_a_full_queue_and_a_timeout_are_503s_with_retry_after():
    router, activator = routes(StaticEndpointSource([])), Activator(poll_interval=0.01)
    activator.configure("m", HoldPolicy(queue_size=1, timeout=1))
    first = asyncio.create_task(activator.wait_for_replica("m", lambda: router.has_replicas("m")))
    await asyncio.sleep(0.05)
    with pytest.raises(ServiceUnavailable) as full:
        await activator.wait_for_replica("m", lambda: router.has_replicas("m"))
    with pytest.raises(ServiceUnavailable) as late:
        await first
    for refused in (full.value, late.value):
        status, _, code, headers = as_error(refused)
        assert (status, code) == (503, "model_starting") and int(headers["Retry-After"]) >= 1
    assert activator.held("m") == 0


async def test_a_model_without_a_hold_policy_is_not_held():
    router, activator = routes(StaticEndpointSource([])), Activator()
    await asyncio.wait_for(activator.wait_for_replica("m", lambda: router.has_replicas("m")), 1)
