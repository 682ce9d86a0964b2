"""Prefix keys, the ring, and prefix affinity under bounded load."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from inferplane.control_plane.routing import (
    Deployment,
    HashRing,
    Router,
    RouteRequest,
    StaticEndpointSource,
    block_hashes,
    bounded_pick,
    load_bound,
    prefix_key,
)

BLOCK = 16


def _prompt(seed: int, n_tokens: int = 80) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32000) for _ in range(n_tokens)]


def _router(n: int, **dep_kwargs: object) -> tuple[Router, StaticEndpointSource]:
    source = StaticEndpointSource(f"10.0.0.{i}:50051" for i in range(n))
    dep = Deployment("d", source, block_size=BLOCK, **dep_kwargs)  # type: ignore[arg-type]
    return Router({"m": [dep]}, rng=random.Random(0)), source


# -- prefix hashing ----------------------------------------------------------------------------------

def test_block_hashes_are_chained_and_ignore_partial_blocks() -> None:
    a = _prompt(1, 3 * BLOCK + 5)
    hashes = block_hashes(a, BLOCK)
    assert len(hashes) == 3
    b = list(a)
    b[0] += 1  # change the first block only: every later hash changes too (chaining)
    assert all(x != y for x, y in zip(hashes, block_hashes(b, BLOCK), strict=True))
    c = list(a)
    c[-1] += 1  # change the partial tail: nothing changes
    assert block_hashes(c, BLOCK) == hashes


def test_cache_salt_separates_tenants() -> None:
    p = _prompt(2)
    assert block_hashes(p, BLOCK, "tenant-a")[-1] != block_hashes(p, BLOCK, "tenant-b")[-1]
    assert prefix_key(p, BLOCK, "tenant-a") != prefix_key(p, BLOCK, "tenant-b")
    assert prefix_key(p, BLOCK, "tenant-a") == prefix_key(list(p), BLOCK, "tenant-a")


def test_prefix_key_uses_only_the_first_blocks() -> None:
    p = _prompt(3, 10 * BLOCK)
    longer = p + _prompt(4, 5 * BLOCK)
    assert prefix_key(p, BLOCK, affinity_blocks=2) == prefix_key(longer, BLOCK, affinity_blocks=2)
    assert prefix_key(p[: BLOCK - 1], BLOCK) is None
    assert prefix_key([], BLOCK) is None and prefix_key(None, BLOCK) is None


# -- ring ---------------------------------------------------------------------------------------------

def test_ring_walk_lists_each_member_once() -> None:
    ring = HashRing([f"r{i}" for i in range(5)], vnodes=50)
    walked = list(ring.walk(12345))
    assert sorted(walked) == [f"r{i}" for i in range(5)] and walked[0] == ring.owner(12345)
    assert list(HashRing([]).walk(1)) == []


def test_load_bound_always_leaves_room() -> None:
    for total in range(0, 50):
        for n in range(1, 8):
            assert load_bound(total, n, 0.25) * n >= total + 1


@pytest.mark.parametrize("n", [4, 8])
def test_adding_or_removing_a_replica_moves_about_one_nth_of_prefixes(n: int) -> None:
    members = [f"10.0.0.{i}:50051" for i in range(n)]
    keys = [prefix_key(_prompt(s), BLOCK) for s in range(4000)]
    before = HashRing(members)
    grown = HashRing([*members, "10.0.0.99:50051"])
    shrunk = HashRing(members[1:])
    owners = [before.owner(k) for k in keys]  # type: ignore[arg-type]
    moved_add = [o for k, o in zip(keys, owners, strict=True) if grown.owner(k) != o]  # type: ignore[arg-type]
    moved_del = [o for k, o in zip(keys, owners, strict=True) if shrunk.owner(k) != o]  # type: ignore[arg-type]
    # Adding: only keys that now belong to the new member move; about 1/(n+1) of them.
    assert all(grown.owner(k) == "10.0.0.99:50051" for k, o in zip(keys, owners, strict=True)  # type: ignore[arg-type]
               if grown.owner(k) != o)  # type: ignore[arg-type]
    assert abs(len(moved_add) / len(keys) - 1 / (n + 1)) < 0.06
    # Removing: only the removed member's keys move; about 1/n of them.
    assert set(moved_del) == {members[0]}
    assert abs(len(moved_del) / len(keys) - 1 / n) < 0.06


# -- affinity through the router ---------------------------------------------------------------------

def test_same_prefix_goes_to_the_same_replica() -> None:
    router, _ = _router(6)
    for s in range(50):
        req = RouteRequest("m", token_ids=_prompt(s))
        first = router.pick(req)
        first.release(True)
        for _ in range(5):  # the same prefix with a different tail
            lease = router.pick(RouteRequest("m", token_ids=_prompt(s)[: 2 * BLOCK] + _prompt(1000 + s)))
            assert lease.address == first.address
            lease.release(True)


def test_affinity_survives_moderate_concurrent_load() -> None:
    """Many distinct prefixes held open at once: nearly all still land on their ring owner."""
    router, _ = _router(4)
    ring = HashRing(router.addresses())
    prompts = [_prompt(s) for s in range(200)]
    leases = [router.pick(RouteRequest("m", token_ids=p)) for p in prompts]
    at_owner = sum(lease.address == ring.owner(prefix_key(p, BLOCK)) for lease, p in  # type: ignore[arg-type]
                   zip(leases, prompts, strict=True))
    assert at_owner / len(prompts) > 0.7
    loads = Counter(lease.address for lease in leases)
    assert max(loads.values()) <= math.ceil(1.25 * len(prompts) / 4)


def test_flood_of_one_prefix_stays_within_the_bound() -> None:
    eps, n = 0.25, 5
    router, _ = _router(n, load_epsilon=eps)
    req = RouteRequest("m", token_ids=_prompt(7))
    leases = [router.pick(req)]
    owner = leases[0].address
    for _ in range(300):  # nothing finishes: no replica ever exceeds the bound
        leases.append(router.pick(req))
        loads = [router.load.outstanding(a) for a in router.addresses()]
        assert max(loads) <= math.ceil((1 + eps) * sum(loads) / n)
    assert router.load.outstanding(owner) == max(router.load.outstanding(a) for a in router.addresses())
    rnd = random.Random(3)
    for _ in range(300):  # with departures the bound is enforced at every placement
        leases.pop(rnd.randrange(len(leases))).release(True)
        if rnd.random() < 0.5:
            leases.pop(rnd.randrange(len(leases))).release(True)
        lease = router.pick(req)
        leases.append(lease)
        total = sum(router.load.outstanding(a) for a in router.addresses())
        assert router.load.outstanding(lease.address) <= math.ceil((1 + eps) * total / n)


def test_bounded_pick_steps_over_full_and_absent_members() -> None:
    ring = HashRing(["a", "b", "c"])
    key = 42
    order = list(ring.walk(key))
    loads = {order[0]: 10, order[1]: 0, order[2]: 0}
    assert bounded_pick(ring, key, loads, 0.25) == order[1]
    assert bounded_pick(ring, key, {order[2]: 3}, 0.25) == order[2]  # the others are not candidates
    assert bounded_pick(ring, key, {}, 0.25) is None


def test_prompts_without_a_full_block_go_to_the_least_loaded() -> None:
    router, _ = _router(3)
    held = [router.pick(RouteRequest("m", token_ids=[1, 2, 3])) for _ in range(9)]
    assert sorted(Counter(lease.address for lease in held).values()) == [3, 3, 3]
    busy = held[0].address
    for lease in held:
        if lease.address != busy:
            lease.release(True)
    nxt = router.pick(RouteRequest("m", token_ids=None))
    assert nxt.address != busy


def test_an_adapters_requests_go_where_it_is_loaded_and_spill_under_load() -> None:
    """Whatever the prompt, an adapter's requests land on one replica (its slot stays warm) while
    that replica is under the load bound; beyond it they spill, within the bound, to others."""
    router, _ = _router(6)
    owners = {}
    for adapter in ("support@aa", "sales@bb", "legal@cc"):
        places = set()
        for s in range(20):  # different prompts, one at a time
            lease = router.pick(RouteRequest("m", token_ids=_prompt(s), adapter=adapter))
            places.add(lease.address)
            lease.release(True)
        assert len(places) == 1
        owners[adapter] = places.pop()
    assert len(set(owners.values())) > 1  # the adapters spread over the replicas
    held = [router.pick(RouteRequest("m", token_ids=_prompt(s), adapter="support@aa")) for s in range(60)]
    loads = Counter(lease.address for lease in held)
    assert loads.most_common(1)[0][0] == owners["support@aa"] and len(loads) > 1
    assert max(loads.values()) <= math.ceil(1.25 * len(held) / 6)
