"""The gateway's KV index (from the workers' KV events) and the routing policies that read it."""

from __future__ import annotations

import random

import pytest

from inferplane.api.deployment import InferenceDeploymentSpec, SpecError
from inferplane.api.resolve import resolve
from inferplane.control_plane.gateway.served_routes import ResourceRoute, router_deployment
from inferplane.control_plane.routing import Deployment, Router, RouteRequest, StaticEndpointSource, prefix_key
from inferplane.control_plane.routing.kv_index import KVIndex
from inferplane.control_plane.routing.prefix import block_hashes
from inferplane.v1 import worker_pb2

BS = 16
REPLICAS = [f"10.0.0.{i}:50051" for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(seed: int, n: int = 20 * BS) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32000) for _ in range(n)]


def names(tokens: list[int], salt: str = "") -> list[bytes]:
    """What the router looks up: full blocks before the last token."""
    return block_hashes(tokens[:-1], BS, salt)


def stored(medium: str, hashes, *, snapshot: bool = False, instance: str = "w1") -> worker_pb2.KVEventBatch:
    events = [worker_pb2.KVEvent(all_cleared=worker_pb2.KVAllBlocksCleared())] if snapshot else []
    events.append(worker_pb2.KVEvent(stored=worker_pb2.KVBlockStored(block_hashes=hashes, medium=medium,
                                                                     block_size=BS)))
    return worker_pb2.KVEventBatch(snapshot=snapshot, instance_id=instance, events=events)


def removed(medium: str, hashes, instance: str = "w1") -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(instance_id=instance, events=[
        worker_pb2.KVEvent(removed=worker_pb2.KVBlockRemoved(block_hashes=hashes, medium=medium))])


# -- the index -------------------------------------------------------------------------------------

def test_held_runs_count_leading_blocks_weighted_by_medium() -> None:
    index = KVIndex()
    h = names(prompt(1))
    index.apply("a", stored("pool", h[:6], snapshot=True))
    index.apply("b", stored("disk", h[:10], snapshot=True))
    index.apply("c", stored("memory", h[:3] + h[4:9], snapshot=True))  # a gap at block 3 ends its run
    index.apply("c", stored("pool", h[:2]))
    runs = index.held_runs(h, ["a", "b", "c", "d"])
    assert runs == {"a": 6.0, "b": 5.0, "c": pytest.approx(1.0 + 1.0 + 0.8)}
    assert index.held_runs(names(prompt(2)), ["a", "b", "c"]) == {}
    assert index.replica_blocks("c") == {"memory": 8, "pool": 2} and index.blocks() == 10


def test_removal_a_snapshot_and_a_new_worker_process_replace_what_was_known() -> None:
    index = KVIndex()
    h = names(prompt(3))
    index.apply("a", stored("pool", h[:8], snapshot=True))
    index.apply("a", stored("disk", h[:8]))
    index.apply("a", removed("pool", h[4:8]))
    assert index.held_runs(h, ["a"]) == {"a": 4 * 1.0 + 4 * 0.5}
    index.apply("a", stored("disk", h[:2], snapshot=True))  # a reconnect: the snapshot is all there is
    assert index.held_runs(h, ["a"]) == {"a": 1.0}
    index.apply("a", stored("pool", h[:1], instance="w2"))  # another process at the address
    assert index.held_runs(h, ["a"]) == {"a": 1.0} and index.replica_blocks("a") == {"pool": 1}
    index.drop("a")
    assert index.held_runs(h, ["a"]) == {} and index.blocks() == 0 and index.replicas() == []


def test_a_provisional_entry_counts_until_events_confirm_it_or_it_expires() -> None:
    clock = Clock()
    index = KVIndex(provisional_ttl_s=10, clock=clock)
    h = names(prompt(4))
    index.note_routed("a", h[:5])
    assert index.held_runs(h, ["a", "b"]) == {"a": 5.0}
    index.apply("a", stored("pool", h[:3], snapshot=True))  # the worker says what it really holds
    clock.now += 11
    assert index.held_runs(h, ["a"]) == {"a": 3.0}
    assert index.expire() == 2 and index.expire() == 0


# -- routing ---------------------------------------------------------------------------------------

def kv_router(policy: str = "kv-aware", **kwargs) -> Router:
    source = StaticEndpointSource(REPLICAS)
    return Router({"m": [Deployment("d", source, block_size=BS, routing_policy=policy, **kwargs)]},
                  rng=random.Random(0))


def test_kv_aware_goes_where_the_prompts_blocks_are_not_where_the_ring_points() -> None:
    router = kv_router()
    tokens = prompt(5)
    ring_owner = kv_router("prefix-hash").pick(RouteRequest("m", token_ids=tokens))  # the same ring
    holder = next(a for a in REPLICAS if a != ring_owner.address)
    router.kv_index.apply(holder, stored("memory", names(tokens), snapshot=True))
    router.kv_index.apply(ring_owner.address, stored("pool", names(tokens)[:2], snapshot=True))
    lease = router.pick(RouteRequest("m", token_ids=tokens))
    assert lease.address == holder  # 19 blocks in memory (15.2) outweigh 2 in the pool
    assert router.decisions[("kv-aware", "held")] == 1
    # Another tenant's names for the same tokens are not held anywhere: the ring decides.
    other = router.pick(RouteRequest("m", token_ids=tokens, cache_salt="tenant-b"))
    assert router.decisions[("kv-aware", "ring")] == 1
    lease.release(True)
    other.release(True)


def test_kv_aware_stays_within_bounded_load() -> None:
    router = kv_router(load_epsilon=0.25)
    tokens = prompt(6)
    holder = REPLICAS[1]
    router.kv_index.apply(holder, stored("pool", names(tokens), snapshot=True))
    leases = [router.pick(RouteRequest("m", token_ids=tokens)) for _ in range(12)]
    counts = {a: sum(lease.address == a for lease in leases) for a in REPLICAS}
    assert counts[holder] == max(counts.values())
    assert counts[holder] <= 4  # ceil(1.25 * 12 / 4): the excess goes elsewhere
    for lease in leases:
        lease.release(True)


def test_a_burst_on_a_new_prefix_goes_to_one_replica_and_is_noted() -> None:
    router = kv_router()
    system = prompt(7, 6 * BS)
    picked = []
    for i in range(3):  # before any event from the replica
        lease = router.pick(RouteRequest("m", token_ids=system + prompt(100 + i, 2 * BS)))
        picked.append(lease.address)
        lease.release(True)
    assert len(set(picked)) == 1
    # The first went by the ring; the next two found it noted (provisional) and followed it.
    assert router.decisions[("kv-aware", "ring")] == 1 and router.decisions[("kv-aware", "held")] == 2


def test_prefix_hash_ignores_the_index_and_least_loaded_ignores_the_prompt() -> None:
    tokens = prompt(8)
    router = kv_router("prefix-hash")
    owner = router.pick(RouteRequest("m", token_ids=tokens))
    owner.release(True)
    router.kv_index.apply(next(a for a in REPLICAS if a != owner.address), stored("pool", names(tokens), snapshot=True))
    assert router.pick(RouteRequest("m", token_ids=tokens)).address == owner.address
    assert prefix_key(tokens, BS) is not None and router.kv_aware_addresses() == set()

    router = kv_router("least-loaded")
    leases = [router.pick(RouteRequest("m", token_ids=tokens)) for _ in range(4)]
    assert sorted(lease.address for lease in leases) == sorted(REPLICAS)
    assert router.decisions[("least-loaded", "least_loaded")] == 4


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy"):
        Deployment("d", StaticEndpointSource(REPLICAS), routing_policy="round-robin")


# -- the spec --------------------------------------------------------------------------------------

def spec(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.from_dict({"model": {"uri": "/models/m.gguf", "format": "gguf"}, **fields})


def test_the_policy_defaults_to_kv_aware_where_tiers_and_events_are_on() -> None:
    assert resolve(spec(engine={"kvOffloadMemory": "1Gi"})).routing_policy == "kv-aware"
    assert resolve(spec()).routing_policy == "prefix-hash"  # events on (cpu-int8), but no tiers
    assert resolve(spec(engine={"kvOffloadMemory": "1Gi", "kvEvents": False})).routing_policy == "prefix-hash"
    assert resolve(spec(routing={"policy": "least-loaded"}, engine={"kvOffloadMemory": "1Gi"})).routing_policy \
        == "least-loaded"
    # auto on a GPU picks the radix runtime where kv-aware routing is asked for (its events).
    assert resolve(spec(resources={"gpus": 1}, routing={"policy": "kv-aware"})).runtime == "radix"
    route = ResourceRoute.of("d", spec(engine={"kvOffloadDisk": "10Gi"}), namespace="ns")
    deployment = router_deployment(route, StaticEndpointSource(REPLICAS))
    assert deployment.routing_policy == "kv-aware"
    assert Router({"m": [deployment]}).kv_aware_addresses() == set(REPLICAS)


@pytest.mark.parametrize(("fields", "field"), [
    ({"runtime": "paged", "resources": {"gpus": 1}, "routing": {"policy": "kv-aware"}}, "routing.policy"),
    ({"engine": {"kvEvents": False}, "routing": {"policy": "kv-aware"}}, "routing.policy"),
    ({"runtime": "paged", "resources": {"gpus": 1}, "engine": {"kvEvents": True}}, "engine.kvEvents"),
    ({"routing": {"policy": "round-robin"}}, "routing.policy"),
])
def test_settings_kv_aware_routing_cannot_honour_are_refused_naming_the_field(fields, field) -> None:
    with pytest.raises(SpecError) as err:
        spec(**fields)
    assert err.value.field == field


def test_new_conversations_behind_a_shared_system_prompt_spread_and_their_next_turns_follow() -> None:
    router = kv_router()
    system = prompt(9, 16 * BS)
    holder = REPLICAS[2]
    router.kv_index.apply(holder, stored("pool", names(system + [0]), snapshot=True))  # the system prompt only
    firsts = [system + prompt(200 + i, 20 * BS) for i in range(12)]
    placed = []
    for tokens in firsts:
        lease = router.pick(RouteRequest("m", token_ids=tokens))
        placed.append(lease.address)
        lease.release(True)
    # Less than half of each prompt is held: the ring spreads them by their own blocks.
    assert len(set(placed)) >= 3 and router.decisions[("kv-aware", "ring")] == 12
    for tokens, address in zip(firsts, placed, strict=True):
        router.kv_index.apply(address, stored("pool", names(tokens)))
    for tokens, address in zip(firsts, placed, strict=True):
        lease = router.pick(RouteRequest("m", token_ids=tokens + prompt(300, 3 * BS)))
        assert lease.address == address  # the next turn goes where its history is
        lease.release(True)
