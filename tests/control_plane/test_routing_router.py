"""Deployment choice: A/B weights, spillover tier, saturation, health."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inferplane.control_plane.routing import (
    Deployment,
    HealthTracker,
    LoadTracker,
    NoReplicaAvailable,
    Router,
    RouteRequest,
    StaticEndpointSource,
    Tier,
    UnknownModel,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _source(prefix: str, n: int) -> StaticEndpointSource:
    return StaticEndpointSource(f"{prefix}.{i}:50051" for i in range(n))


def _prompt(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32000) for _ in range(64)]


def _ab_router(seed: int = 0) -> Router:
    return Router({"m": [Deployment("a", _source("10.0.1", 3), weight=70),
                         Deployment("b", _source("10.0.2", 2), weight=30)]}, rng=random.Random(seed))


def test_ab_weights_hold_within_five_percent_over_2000_requests() -> None:
    router = _ab_router()
    counts: Counter[str] = Counter()
    for s in range(2000):
        lease = router.pick(RouteRequest("m", token_ids=_prompt(s)))
        counts[lease.deployment.name] += 1
        lease.release(True)
    assert abs(counts["a"] / 2000 - 0.70) <= 0.05
    assert abs(counts["b"] / 2000 - 0.30) <= 0.05


def test_ab_key_pins_the_arm_and_still_splits_by_weight() -> None:
    router = _ab_router()
    counts: Counter[str] = Counter()
    for user in range(2000):
        arms = set()
        for _ in range(3):
            lease = router.pick(RouteRequest("m", ab_key=f"user-{user}"))
            arms.add(lease.deployment.name)
            lease.release(True)
        assert len(arms) == 1  # the same user always sees the same arm
        counts[arms.pop()] += 1
    assert abs(counts["a"] / 2000 - 0.70) <= 0.05


def test_arm_with_no_healthy_replica_gives_its_share_to_the_others() -> None:
    router = _ab_router()
    for i in range(2):
        router.health.mark_unhealthy(f"10.0.2.{i}:50051")
    names = {router.pick(RouteRequest("m", ab_key=f"u{u}")).deployment.name for u in range(200)}
    assert names == {"a"}


def _tiered(max_outstanding: int = 2, *, max_waiting: int | None = None,
            clock: FakeClock | None = None) -> tuple[Router, StaticEndpointSource, StaticEndpointSource]:
    gpu, cpu = _source("10.0.1", 2), _source("10.0.9", 2)
    clock = clock or FakeClock()
    router = Router({"m": [
        Deployment("gpu", gpu, max_outstanding=max_outstanding, max_waiting=max_waiting),
        Deployment("cpu", cpu, tier=Tier.SPILLOVER, max_outstanding=max_outstanding),
    ]}, load=LoadTracker(clock=clock), health=HealthTracker(clock=clock), rng=random.Random(1))
    return router, gpu, cpu


def test_spillover_only_when_primaries_are_saturated() -> None:
    router, _, _ = _tiered(max_outstanding=2)
    held = []
    for s in range(4):  # 2 replicas x 2: fills the primaries exactly
        lease = router.pick(RouteRequest("m", token_ids=_prompt(s)))
        assert lease.deployment.name == "gpu"
        held.append(lease)
    spill = router.pick(RouteRequest("m", token_ids=_prompt(99)))
    assert spill.deployment.name == "cpu"
    held[0].release(True)  # one primary slot frees up: back to the primary tier
    assert router.pick(RouteRequest("m", token_ids=_prompt(100))).deployment.name == "gpu"


def test_spillover_when_primaries_have_no_healthy_replica_or_none_at_all() -> None:
    router, gpu, _ = _tiered()
    for ep in gpu.endpoints():
        router.health.mark_unhealthy(ep.address)
    assert router.pick(RouteRequest("m")).deployment.name == "cpu"
    router2, gpu2, _ = _tiered()
    gpu2.set([])  # scaled to zero
    assert router2.pick(RouteRequest("m")).deployment.name == "cpu"


def test_everything_saturated_queues_on_the_primaries() -> None:
    router, _, _ = _tiered(max_outstanding=1)
    for _ in range(4):
        router.pick(RouteRequest("m"))
    assert router.pick(RouteRequest("m")).deployment.name == "gpu"


def test_reported_queue_length_saturates_and_expires() -> None:
    clock = FakeClock()
    router, gpu, _ = _tiered(max_outstanding=100, max_waiting=4, clock=clock)
    for ep in gpu.endpoints():
        router.load.report_waiting(ep.address, 7)  # fed from the workers' Stats num_waiting
    assert router.pick(RouteRequest("m")).deployment.name == "cpu"
    clock.now += 60  # stale stats are ignored
    assert router.pick(RouteRequest("m")).deployment.name == "gpu"


def test_unhealthy_replicas_are_skipped_and_come_back() -> None:
    clock = FakeClock()
    src = _source("10.0.1", 3)
    router = Router({"m": [Deployment("d", src)]}, health=HealthTracker(clock=clock, cooldown_s=30),
                    rng=random.Random(0))
    dead = "10.0.1.0:50051"
    for _ in range(3):
        router.health.record_failure(dead)
    picks = set()
    for s in range(100):
        lease = router.pick(RouteRequest("m", token_ids=_prompt(s)))
        picks.add(lease.address)
        lease.release(None)
    assert dead not in picks and len(picks) == 2
    router.health.record_success(dead)  # a health check passed
    assert dead in router.addresses() and router.health.is_healthy(dead)
    for _ in range(3):
        router.health.record_failure(dead)
    clock.now += 31  # cooldown over: half-open again even without a poller
    assert router.health.is_healthy(dead)


def test_unknown_model_and_nothing_available() -> None:
    router, gpu, cpu = _tiered()
    with pytest.raises(UnknownModel):
        router.pick(RouteRequest("nope"))
    everything = [ep.address for ep in (*gpu.endpoints(), *cpu.endpoints())]
    with pytest.raises(NoReplicaAvailable):
        router.pick(RouteRequest("m"), exclude=everything)


def test_lease_release_is_idempotent_and_tracks_outstanding() -> None:
    router = _ab_router()
    lease = router.pick(RouteRequest("m"))
    assert router.load.outstanding(lease.address) == 1
    lease.release(False)
    lease.release(False)
    assert router.load.outstanding(lease.address) == 0
    assert router.health.is_healthy(lease.address)  # one failure is below the threshold


def test_routes_can_be_replaced_at_runtime() -> None:
    router = _ab_router()
    router.set_route("m2", [Deployment("c", _source("10.0.3", 1))])
    assert router.models() == ["m", "m2"]
    assert router.pick(RouteRequest("m2")).deployment.name == "c"
    router.remove_route("m2")
    with pytest.raises(UnknownModel):
        router.pick(RouteRequest("m2"))
    with pytest.raises(ValueError):
        router.set_route("m3", [Deployment("x", _source("1", 1)), Deployment("x", _source("2", 1))])


def test_health_tracker_thresholds() -> None:
    clock = FakeClock()
    t = HealthTracker(failure_threshold=2, recovery_threshold=2, cooldown_s=10, clock=clock)
    assert t.is_healthy("x")  # unknown replicas get traffic at once
    t.record_failure("x")
    t.record_success("x")  # a success resets the run of failures
    t.record_failure("x")
    assert t.is_healthy("x")
    t.record_failure("x")
    assert not t.is_healthy("x")
    t.record_success("x")
    assert not t.is_healthy("x")  # needs two passing checks
    t.record_success("x")
    assert t.is_healthy("x")
    t.mark_unhealthy("x")
    assert not t.is_healthy("x")
    t.forget("x")
    assert t.is_healthy("x")
