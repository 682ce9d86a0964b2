"""The radix runtime end to end: greedy outputs with the prefix cache equal outputs without it."""

from __future__ import annotations

import pytest

from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.llm import LLM

from .conftest import prompts_of_lengths

BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """A paged engine (the reference) and a radix one with room to spare; tests that need memory
    pressure build their own."""
    return (LLM(tiny_llama, runtime="paged", block_size=BS, num_kv_blocks=256),
            LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=256))


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("shared", [1, 3, 4, 5, 8, 13, 16])
def test_shared_prefix_at_every_alignment(engines, shared):
    paged, radix = engines
    stem, tail_a, tail_b = prompts_of_lengths([shared, 6, 5], 320, seed=shared)
    tail_b[0] = (tail_a[0] + 1) % 320  # the prompts part exactly after `shared` tokens
    first, second = stem + tail_a, stem + tail_b
    salt = f"align-{shared}"  # a namespace of its own: no hits from the other cases
    out = radix.generate([first], GREEDY, cache_salt=salt) + radix.generate([second], GREEDY, cache_salt=salt)
    assert [o.num_cached_tokens for o in out] == [0, shared // BS * BS]
    assert tokens(out) == tokens(paged.generate([first, second], GREEDY))


def test_multi_turn_reuses_the_previous_answer(engines):
    paged, radix = engines
    history = prompts_of_lengths([21], 320, seed=7)[0]
    for turn in range(3):
        ours, ref = radix.generate(history, GREEDY, cache_salt="chat")[0], paged.generate(history, GREEDY)[0]
        assert ours.token_ids == ref.token_ids
        if turn:
            # Everything the previous turn computed (its prompt and all but its last token) is reused.
            assert ours.num_cached_tokens == (len(history) - 3 - 1) // BS * BS
        history = history + ours.token_ids + [turn + 1, turn + 2, turn + 3]


def test_concurrent_requests_sharing_a_prefix(engines):
    paged, radix = engines
    stem = prompts_of_lengths([30], 320, seed=11)[0]
    tails = prompts_of_lengths([1, 2, 3, 7, 4, 9], 320, seed=12)
    prompts = [stem + t for t in tails] + [stem[:10] + t for t in tails[:2]]
    before = radix.stats()
    outs = radix.generate(prompts, GREEDY, cache_salt="burst")
    assert tokens(outs) == tokens(paged.generate(prompts, GREEDY))
    # The first request computes the stem once; the others, held back a step, reuse it.
    assert [o.num_cached_tokens for o in outs] == [0, 28, 28, 28, 28, 28, 8, 8]
    after = radix.stats()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 5 * 28 + 2 * 8
    assert after["prefix_query_tokens"] - before["prefix_query_tokens"] == sum(len(p) for p in prompts)


def test_eviction_under_memory_pressure(tiny_llama, engines):
    paged, _ = engines
    radix = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=24, max_num_seqs=4)
    stems = prompts_of_lengths([17, 23, 14], 320, seed=21)
    tails = prompts_of_lengths([3, 5, 2, 6], 320, seed=22)
    prompts = [s + t for t in tails for s in stems]
    outs = radix.generate(prompts, GREEDY)
    again = radix.generate(prompts[::-1], GREEDY)
    stats = radix.stats()
    assert stats["evicted_blocks"] > 0
    assert stats["prefix_hit_tokens"] > 0
    reference = tokens(paged.generate(prompts, GREEDY))
    assert tokens(outs) == reference
    assert tokens(again) == reference[::-1]
    assert stats["blocks_used"] == 0 and stats["blocks_cached"] <= 24
    assert stats["peak_blocks_used"] <= 24


def test_salts_isolate_tenants(engines):
    _, radix = engines
    prompt = prompts_of_lengths([25], 320, seed=31)[0]
    radix.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert radix.generate(prompt, GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert radix.generate(prompt, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 24
    # Shared isolation is one salt for everybody (the gateway sends ""): then prefixes are shared.
    radix.generate(prompt, GREEDY)
    assert radix.generate(prompt, GREEDY)[0].num_cached_tokens == 24


def test_stats_report_the_cache(engines):
    _, radix = engines
    stats = radix.stats()
    for key in ("blocks_used", "peak_blocks_used", "blocks_cached", "prefix_query_tokens",
                "prefix_hit_tokens", "evicted_blocks", "tree_nodes"):
        assert key in stats
    assert stats["blocks_used"] == 0  # nothing running
    assert stats["blocks_cached"] > 0 and stats["tree_nodes"] > 0
    assert 0 < stats["prefix_hit_tokens"] <= stats["prefix_query_tokens"]


@pytest.mark.slow
def test_smollm2_multi_turn_chat_matches_paged():
    paged, radix = LLM("smollm2-135m", runtime="paged"), LLM("smollm2-135m", runtime="radix")
    system = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
    questions = ("What is a radix tree?", "Name a prime number.")
    chats = [[system, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for turn in range(2):
        ours, ref = radix.chat(chats, params), paged.chat(chats, params)
        assert tokens(ours) == tokens(ref)
        if turn:
            assert all(o.num_cached_tokens > 0 for o in ours)
        for chat, out in zip(chats, ours, strict=True):
            chat += [{"role": "assistant", "content": out.text}, {"role": "user", "content": "Why?"}]
    assert radix.stats()["prefix_hit_tokens"] > 0
