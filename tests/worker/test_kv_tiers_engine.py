"""The radix runtime with KV tiers: a prefix evicted from the pool, or left on disk by an earlier
worker, is read back instead of computed, and the greedy tokens are the ones computing gives."""

from __future__ import annotations

import pytest

from inferplane.api.kv_blocks import chain_keys
from inferplane.worker.engine.kv.tiers.record import Part
from inferplane.worker.engine.kv.tiers.store import record_name
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.llm import LLM

from .conftest import prompts_of_lengths

BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(tiny_llama, runtime="paged", block_size=BS, num_kv_blocks=256)


def test_a_prefix_evicted_from_the_pool_comes_back_from_memory(tiny_llama, reference):
    llm = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=24, max_num_seqs=2,
              kv_offload_memory="64MiB")
    conversation, *others = prompts_of_lengths([40, 40, 40], 320, seed=41)
    first = llm.generate(conversation, GREEDY, cache_salt="a")[0]
    llm.generate(others, GREEDY, cache_salt="a")  # their blocks push the conversation's out of the pool
    assert llm.stats()["evicted_blocks"] > 0
    again = llm.generate(conversation, GREEDY, cache_salt="a")[0]
    assert again.num_cached_tokens == (40 - 1) // BS * BS  # every full block before the last token
    assert again.token_ids == first.token_ids == reference.generate(conversation, GREEDY)[0].token_ids
    stats = llm.stats()
    assert stats["kv_tier_loaded_blocks_total"] >= 9 and stats["kv_tier_hits_total:memory"] >= 9
    assert stats["kv_tier_read_seconds_total:memory"] > 0  # the reads' time, for the per-block read time panel
    assert stats["blocks_used"] == 0


def test_a_later_worker_reads_the_disk_tier_an_earlier_one_left(tiny_llama, tiny_qwen2, reference, tmp_path):
    disk = {"kv_offload_disk": "64MiB", "kv_offload_dir": str(tmp_path)}
    prompts = prompts_of_lengths([29, 33], 320, seed=42)
    earlier = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **disk)
    computed = earlier.generate(prompts, GREEDY, cache_salt="t1")
    assert earlier.stats()["kv_tier_saved_blocks_total"] > 0
    del earlier

    later = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **disk)
    read_back = later.generate(prompts, GREEDY, cache_salt="t1")
    assert [o.num_cached_tokens for o in read_back] == [28, 32]
    assert tokens(read_back) == tokens(computed) == tokens(reference.generate(prompts, GREEDY))
    assert later.stats()["kv_tier_hits_total:disk"] >= 7 + 8
    # Another tenant's names for the same tokens find nothing there.
    assert later.generate(prompts[0], GREEDY, cache_salt="t2")[0].num_cached_tokens == 0
    # Nor does a worker of another model on the same directory.
    other = LLM(tiny_qwen2, runtime="radix", block_size=BS, num_kv_blocks=64, **disk)
    assert other.generate(prompts[0], GREEDY, cache_salt="t1")[0].num_cached_tokens == 0


def test_a_damaged_block_on_disk_is_computed_again(tiny_llama, reference, tmp_path):
    disk = {"kv_offload_disk": "64MiB", "kv_offload_dir": str(tmp_path)}
    prompt = prompts_of_lengths([25], 320, seed=43)[0]
    LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **disk).generate(prompt, GREEDY)
    third = record_name(chain_keys("", prompt, BS)[2], Part.MAIN).hex()
    (path,) = tmp_path.glob(f"*/*/{third}.kvb")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # one bit of block 2's KV
    path.write_bytes(bytes(data))
    later = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **disk)
    out = later.generate(prompt, GREEDY)[0]
    assert out.token_ids == reference.generate(prompt, GREEDY)[0].token_ids
    # The blocks before the damaged one are read; from it on, the prompt is computed.
    assert out.num_cached_tokens == 2 * BS
    assert later.stats()["kv_tier_rejected_total"] == 1


@pytest.mark.parametrize(("options", "field"), [
    ({"kv_offload_disk": "1GiB"}, "kv_offload_dir"),
    ({"kv_offload_dir": "/tmp/x"}, "kv_offload_disk"),
    ({"kv_offload_memory": "lots"}, "kv_offload_memory"),
    ({"kv_offload_memory": "0"}, "kv_offload_memory"),
])
def test_bad_offload_options_name_the_option(options, field):
    with pytest.raises(ValueError, match=field):
        EngineOptions(**options).validate()


def test_tiers_are_refused_where_they_cannot_work(tiny_llama):
    with pytest.raises(ValueError, match="radix"):
        LLM(tiny_llama, runtime="paged", block_size=BS, num_kv_blocks=16, kv_offload_memory="1MiB")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    """test_architectures' Gemma 3: layers sliding (window 16), full, sliding."""
    from tests.worker.test_architectures import save_family

    return save_family(tmp_path_factory.mktemp("gemma3-tiers"), "gemma3_text", seed=3)


def test_sliding_window_layers_read_their_last_window_back_too(gemma3, tmp_path):
    """Gemma 3: the full layers' blocks and the sliding layers' last window come back from memory and
    from a disk an earlier worker left, and the tokens are transformers' (blocks of 8, window 16)."""
    from tests.worker.conftest import hf_greedy
    from tests.worker.test_architectures import VOCAB

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    history, *others = prompts_of_lengths([100, 100, 100], VOCAB, seed=45)
    expected = hf_greedy(gemma3, [history], 12)[0]
    options = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=30, max_num_seqs=1)
    disk = {"kv_offload_disk": "64MiB", "kv_offload_dir": str(tmp_path)}
    llm = LLM(gemma3, runtime="radix", kv_offload_memory="64MiB", **options, **disk)
    assert llm.generate(history, params)[0].token_ids == expected
    llm.generate(others, params)  # the history's blocks leave the pool
    back = llm.generate(history, params)[0]
    assert back.num_cached_tokens == 96 and back.token_ids == expected
    stats = llm.stats()
    assert stats["evicted_blocks"] > 0 and stats["kv_tier_loaded_blocks_total"] > 0
    # the full layers' blocks the tree had lost, and the sliding layers' last window (blocks 10, 11)
    assert stats["kv_tier_hits_total:memory"] == stats["kv_tier_loaded_blocks_total"] + 2

    later = LLM(gemma3, runtime="radix", **options, **disk)
    again = later.generate(history, params)[0]
    assert again.num_cached_tokens == 96 and again.token_ids == expected


@pytest.mark.slow
def test_smollm2_on_cpu_int8_reads_a_conversation_back_after_a_restart(tmp_path):
    """The cpu-int8 runtime (float16 KV, the fused C decode) across two workers on one disk tier:
    the second turn's history comes from the disk, and its tokens are the ones a worker that keeps
    the history in its pool gives."""
    disk = {"kv_offload_disk": "256MiB", "kv_offload_dir": str(tmp_path), "max_num_seqs": 4}
    params = SamplingParams(max_tokens=24, temperature=0.0)
    turns = [[{"role": "user", "content": "Name three rivers in Europe."}]]
    earlier = LLM("smollm2-135m", runtime="cpu-int8", **disk)
    answer = earlier.chat(turns[0], params, cache_salt="tenant")[0]
    second_turn = [*turns[0], {"role": "assistant", "content": answer.text},
                   {"role": "user", "content": "Which of them is the longest?"}]
    kept = earlier.chat(second_turn, params, cache_salt="tenant")[0]  # the history from its own pool
    assert kept.num_cached_tokens > 0
    del earlier

    later = LLM("smollm2-135m", runtime="cpu-int8", **disk)
    read_back = later.chat(second_turn, params, cache_salt="tenant")[0]
    # The earlier worker saved the second turn's prompt too: all of it but the last token is read.
    block = later.engine.block_size
    assert read_back.num_cached_tokens == (len(second_turn_ids := read_back.prompt_token_ids) - 1) // block * block
    assert read_back.num_cached_tokens > kept.num_cached_tokens and second_turn_ids == kept.prompt_token_ids
    assert read_back.token_ids == kept.token_ids
    assert later.stats()["kv_tier_hits_total:disk"] * block == read_back.num_cached_tokens


async def test_the_serving_side_reads_a_prompts_kv_ahead_off_the_engine_thread(tiny_llama, reference, tmp_path):
    from inferplane.worker.serve.async_engine import AsyncEngine

    disk = {"kv_offload_disk": "64MiB", "kv_offload_dir": str(tmp_path)}
    prompt = prompts_of_lengths([37], 320, seed=44)[0]
    LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **disk).generate(prompt, GREEDY)
    later = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **disk)
    served = AsyncEngine(later.engine)
    try:
        outs = [out async for out in served.submit("r1", prompt, GREEDY)]
    finally:
        served.stop()
    assert [t for o in outs for t in o.new_token_ids] == reference.generate(prompt, GREEDY)[0].token_ids
    assert outs[-1].num_cached_tokens == 36
    stats = later.stats()
    # Every block the match used was read ahead; the engine's thread read none from the disk itself.
    assert stats["kv_tier_prefetched_total"] == 9 and stats["kv_tier_hits_total:prefetched"] == 9
    assert stats["kv_tier_hits_total:disk"] == 0
