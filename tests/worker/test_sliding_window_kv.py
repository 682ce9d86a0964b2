"""Sliding-window layers keep only their window in the KV pool (kv/window.py), and nothing changes
in what is computed: greedy tokens still equal transformers' while the window pool holds a few
blocks per sequence, under chunked prefill, preemption, forks (n > 1), radix prefix hits and the
eviction of window blocks the radix tree cached.

The checkpoint is test_architectures' Gemma 3 (window 16, layers sliding, full, sliding) with
blocks of 8 tokens, so a 100-token context spans 13 blocks and a window at most 4.
"""

from __future__ import annotations

import pytest

from inferplane import LLM, SamplingParams
from inferplane.worker.engine.kv.window import NULL_BLOCK, WindowBlocks, first_needed, window_pool_blocks
from inferplane.worker.engine.sequence import Sequence
from tests.worker.conftest import hf_greedy, prompts_of_lengths
from tests.worker.test_architectures import VOCAB, save_family

BLOCK = 8
WINDOW = 16
NEW = 12


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    return save_family(tmp_path_factory.mktemp("gemma3-window"), "gemma3_text", seed=3)


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, n=n)


def _llm(path: str, **options) -> LLM:
    return LLM(path, device="cpu", dtype="float32", block_size=BLOCK, **options)


def test_window_table_frees_exactly_what_no_later_query_reads():
    windows = WindowBlocks(num_blocks=20, block_size=4, window=6)
    seq = Sequence(request_id="a", prompt_token_ids=list(range(30)), params=SamplingParams(), max_tokens=4,
                   rng_key=0)
    windows.grow(seq, 8)  # 32 positions
    seq.num_computed_tokens = 30
    assert windows.trim(seq) == 6  # blocks 0..5 end before position 30 - 6 = 24
    assert seq.window_table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in seq.window_table[6:]
    assert first_needed(30, 6) == 24 and windows.blocks_used() == 2
    windows.free(seq)
    assert windows.blocks_used() == 0 and seq.window_table == []


def test_paged_holds_one_window_per_sequence_and_equals_transformers(gemma3):
    prompts = prompts_of_lengths([100, 70, 33], vocab=VOCAB, seed=21)
    expected = hf_greedy(gemma3, prompts, NEW)
    # 16-token steps: prompts come in chunks, and each chunk's window blocks go back after it
    llm = _llm(gemma3, max_num_batched_tokens=16, max_num_seqs=3)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["peak_blocks_used"] >= 14 + 10  # the full layers hold every context whole
    # three windows of at most (16 + one 16-token step) / 8 + 2 blocks each
    assert 0 < stats["window_peak_blocks_used"] <= 3 * 6
    assert stats["window_blocks_used"] == 0 and stats["blocks_used"] == 0
    assert stats["window_blocks_total"] == window_pool_blocks(WINDOW, BLOCK, 3, 16) - 1


def test_preemption_and_forks_keep_the_window_right(gemma3):
    prompts = prompts_of_lengths([90, 60, 41], vocab=VOCAB, seed=22)
    expected = hf_greedy(gemma3, prompts, NEW)
    llm = _llm(gemma3, num_kv_blocks=24, max_num_batched_tokens=24)
    outs = llm.generate(prompts, _greedy(n=3))  # greedy choices of a request all equal the one greedy answer
    assert llm.stats()["preemptions"] > 0 and llm.stats()["forked_sequences"] > 0
    assert [o.token_ids for o in outs] == [want for want in expected for _ in range(3)]


def test_radix_hits_need_the_window_and_keep_it(gemma3):
    system = prompts_of_lengths([60], vocab=VOCAB, seed=23)[0]
    first, second = (system + tail for tail in prompts_of_lengths([40, 30], vocab=VOCAB, seed=24))
    llm = _llm(gemma3, runtime="radix")
    out1 = llm.generate([first], _greedy())[0]
    turn2 = first + out1.token_ids + prompts_of_lengths([9], vocab=VOCAB, seed=25)[0]
    out2, out3 = llm.generate([turn2], _greedy())[0], llm.generate([second], _greedy())[0]
    assert [out1.token_ids, out2.token_ids, out3.token_ids] == hf_greedy(gemma3, [first, turn2, second], NEW)
    # the next turn finds the whole first turn (its full blocks of computed tokens: all but the last
    # answer token); the shared system prompt is found too, although the first request's window
    # moved on: the tree kept those blocks
    assert out2.num_cached_tokens == (len(first) + NEW - 1) // BLOCK * BLOCK
    assert out3.num_cached_tokens == len(system) // BLOCK * BLOCK
    assert llm.stats()["window_blocks_used"] <= llm.stats()["window_blocks_total"]


def test_radix_evicts_cached_window_blocks_and_cuts_matches_where_the_window_is_gone(gemma3):
    prompts = prompts_of_lengths([60, 58, 62, 57], vocab=VOCAB, seed=26)
    expected = hf_greedy(gemma3, prompts, NEW)
    # one sequence at a time and 16-token steps: a window pool of 8 blocks under a main pool of 60,
    # so the tree's cached window blocks must make room while their main blocks stay cached
    llm = _llm(gemma3, runtime="radix", num_kv_blocks=60, max_num_seqs=1, max_num_batched_tokens=16)
    assert llm.stats()["window_blocks_total"] == 7
    outs = [llm.generate([p], _greedy())[0] for p in prompts]
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["window_evicted_blocks"] > 0 and stats["evicted_blocks"] == 0
    # the first prompt's windows went to later requests: its prefix is cut where they are missing
    again = llm.generate([prompts[0]], _greedy())[0]
    assert again.token_ids == expected[0]
    assert again.num_cached_tokens < (len(prompts[0]) - 1) // BLOCK * BLOCK
