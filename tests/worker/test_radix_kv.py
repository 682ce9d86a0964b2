"""RadixKV and its scheduler without a model: matching rules, eviction order, namespaces,
counters, cache-aware ordering, aging and hold-back."""

from __future__ import annotations

import itertools

import pytest

from inferplane.worker.engine.kv.radix import RadixKV
from inferplane.worker.engine.radix_scheduler import RadixScheduler
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence, SequenceStatus

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int], salt: str = "") -> Sequence:
    return Sequence(request_id=f"s{next(_ids)}", prompt_token_ids=list(tokens), params=SamplingParams(),
                    max_tokens=16, rng_key=0, cache_salt=salt)


def run_to_end(kv: RadixKV, seq: Sequence) -> Sequence:
    """Admits a sequence, computes its whole prompt in one chunk and finishes it."""
    kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.on_computed(seq)
    kv.free(seq)
    return seq


def lookup(kv: RadixKV, tokens: list[int], salt: str = "") -> int:
    """Tokens a new sequence would be served from the cache (then lets go of them)."""
    seq = make_seq(tokens, salt)
    kv.match_prefix(seq)
    matched = seq.num_cached_tokens
    kv.free(seq)
    return matched


PREFIX = list(range(100, 112))  # 3 full blocks


@pytest.mark.parametrize(
    ("shared", "expected"),
    [(3, 0), (4, 4), (5, 4), (8, 8), (11, 8), (12, 12)],
    ids=["inside-first-block", "block-edge", "past-edge", "two-blocks", "inside-third", "three-blocks"],
)
def test_match_is_block_aligned(shared, expected):
    kv = RadixKV(32, BS)
    run_to_end(kv, make_seq(PREFIX + [1, 2, 3]))
    assert lookup(kv, PREFIX[:shared] + [7, 7, 7, 7, 7]) == expected


def test_match_always_leaves_the_last_token_to_compute():
    kv = RadixKV(32, BS)
    run_to_end(kv, make_seq(PREFIX + [1, 2, 3, 4]))  # 16 tokens, 4 full blocks cached
    assert lookup(kv, PREFIX) == 8  # identical 12-token prompt: its last block is recomputed
    assert lookup(kv, PREFIX + [1]) == 12
    assert lookup(kv, PREFIX + [1, 2, 3, 4]) == 12


def test_answer_of_one_turn_is_cached_for_the_next():
    kv = RadixKV(32, BS)
    seq = make_seq(PREFIX + [1])
    kv.match_prefix(seq)
    assert kv.allocate(seq, 13)
    seq.num_computed_tokens = 13
    kv.on_computed(seq)
    for token in [5, 6, 7, 8]:  # decode: the KV of each sampled token is written one step later
        seq.output_token_ids.append(token)
        assert kv.allocate(seq, 1)
        seq.num_computed_tokens += 1
        kv.on_computed(seq)
    seq.output_token_ids.append(9)
    kv.free(seq)
    assert lookup(kv, seq.all_token_ids + [42, 43]) == 16  # 17 tokens have KV; 4 full blocks


def test_only_requests_with_the_same_salt_share_prefixes():
    kv = RadixKV(32, BS)
    run_to_end(kv, make_seq(PREFIX + [1], salt="tenant-a"))
    assert lookup(kv, PREFIX + [2], salt="tenant-a") == 12
    assert lookup(kv, PREFIX + [2], salt="tenant-b") == 0
    assert lookup(kv, PREFIX + [2]) == 0
    # "shared" isolation is the gateway sending everybody the same (empty) salt.
    run_to_end(kv, make_seq(PREFIX + [1]))
    assert lookup(kv, PREFIX + [2]) == 12


def test_lru_leaves_are_evicted_first_and_locked_ones_never():
    kv = RadixKV(9, BS)
    old = [1] * 8 + [0]
    new = [2] * 8 + [0]
    run_to_end(kv, make_seq(old))
    run_to_end(kv, make_seq(new))
    assert lookup(kv, new) == 8  # touches `new`: `old` is now least recently used
    holder = make_seq([3] * 8 + [0])
    kv.match_prefix(holder)
    assert kv.allocate(holder, 9)  # needs 3 blocks, 5 free: no eviction yet
    big = make_seq([4] * 11 + [0])
    kv.match_prefix(big)
    assert kv.allocate(big, 12)  # 3 blocks: 2 free + 1 evicted from `old`'s tail
    assert kv.stats()["evicted_blocks"] == 1
    assert lookup(kv, old) == 4 and lookup(kv, new) == 8
    again = make_seq([5] * 20)
    kv.match_prefix(again)
    assert not kv.allocate(again, 20)  # 5 blocks needed, only 3 evictable: refuse, evict nothing
    assert kv.stats()["evicted_blocks"] == 1
    kv.free(again)


def test_counters_and_block_accounting():
    kv = RadixKV(32, BS)
    run_to_end(kv, make_seq(PREFIX + [1, 2, 3, 4]))
    a, b = make_seq(PREFIX + [2, 3]), make_seq(PREFIX + [4, 5])
    for seq in (a, b):
        kv.match_prefix(seq)
        assert kv.allocate(seq, 2)
    stats = kv.stats()
    # 16 + 14 + 14 prompt tokens looked up, 12 + 12 served from the cache.
    assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (44, 24)
    # Three shared prefix blocks counted once, plus one block each for the suffixes.
    assert stats["blocks_used"] == 5 and stats["blocks_cached"] == 1  # the first run's last block
    assert stats["peak_blocks_used"] == 5
    # A preempted sequence looked up again is not a new query.
    kv.free(a)
    a.num_computed_tokens = a.num_cached_tokens = 0
    a.num_preemptions += 1
    kv.match_prefix(a)
    assert kv.allocate(a, a.num_tokens - a.num_computed_tokens)
    assert kv.stats()["prefix_query_tokens"] == 44


# -- the scheduler ----------------------------------------------------------------------------------


def compute_scheduled(sched: RadixScheduler, kv: RadixKV) -> list[Sequence]:
    """One engine step without a model: runs the plan and finishes sequences whose prompt is done."""
    plan = sched.schedule()
    for item in plan.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        kv.on_computed(item.seq)
    for item in plan.scheduled:
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            sched.finish(item.seq)
    return [item.seq for item in plan.scheduled]


def test_longest_prefix_match_is_admitted_first():
    kv = RadixKV(64, BS)
    run_to_end(kv, make_seq(PREFIX + [1]))
    sched = RadixScheduler(kv, max_num_seqs=1, max_num_batched_tokens=256)
    cold, warm = make_seq([9] * 13), make_seq(PREFIX + [2])
    sched.add(cold)
    sched.add(warm)
    assert compute_scheduled(sched, kv) == [warm]
    assert compute_scheduled(sched, kv) == [cold]


def test_above_the_threshold_the_queue_is_first_come_first_served():
    kv = RadixKV(64, BS)
    run_to_end(kv, make_seq(PREFIX + [1]))
    sched = RadixScheduler(kv, max_num_seqs=1, max_num_batched_tokens=256, fcfs_threshold=2)
    seqs = [make_seq([9] * 13), make_seq([8] * 13), make_seq(PREFIX + [2])]
    for seq in seqs:
        sched.add(seq)
    assert compute_scheduled(sched, kv) == [seqs[0]]  # three waiting: arrival order
    assert compute_scheduled(sched, kv) == [seqs[2]]  # two waiting: the cached prefix first again


@pytest.mark.parametrize("aging", [0.0, 4.0])
def test_aging_bounds_how_long_a_cold_request_waits(aging):
    kv = RadixKV(64, BS)
    run_to_end(kv, make_seq(PREFIX + [1]))
    sched = RadixScheduler(kv, max_num_seqs=1, max_num_batched_tokens=256, aging_tokens_per_step=aging)
    cold = make_seq([9] * 13)
    sched.add(cold)
    served_at = None
    for step in range(1, 21):
        sched.add(make_seq(PREFIX + [step % 7 + 2]))  # a fresh warm request (12 cached tokens) each step
        if cold in compute_scheduled(sched, kv):
            served_at = step
            break
    if aging == 0:
        assert served_at is None  # pure longest-prefix-first starves it
    else:
        # Newcomers have priority 12; the cold request reaches 12 after 3 steps of waiting.
        assert served_at is not None and served_at <= 12 / aging + 1


def test_requests_sharing_an_uncached_prefix_compute_it_once():
    kv = RadixKV(64, BS)
    sched = RadixScheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    shared = list(range(200, 220))  # 5 blocks nobody has computed yet
    leader, follower = make_seq(shared + [1, 2]), make_seq(shared + [3])
    other_tenant = make_seq(shared + [4], salt="b")
    for seq in (leader, follower, other_tenant):
        sched.add(seq)
    first = compute_scheduled(sched, kv)
    assert first == [leader, other_tenant]  # the follower waits; another tenant's request never does
    assert follower.status is SequenceStatus.WAITING and sched.waiting[0] is follower
    assert sched.num_held_back == 1
    assert compute_scheduled(sched, kv) == [follower]
    assert follower.num_cached_tokens == 20
    assert kv.stats()["prefix_hit_tokens"] == 20


def test_a_follower_reuses_a_prefix_prefilled_in_chunks():
    kv = RadixKV(64, BS)
    sched = RadixScheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    shared = list(range(300, 324))  # 6 blocks: three 8-token chunks
    leader, follower = make_seq(shared + [1]), make_seq(shared + [2])
    sched.add(leader)
    sched.add(follower)
    for _ in range(3):
        assert compute_scheduled(sched, kv) == [leader]
    # The leader's 24 prefix tokens are in the tree: its last token and the follower run together.
    assert compute_scheduled(sched, kv) == [leader, follower]
    assert follower.num_cached_tokens == 24
