"""Decode graphs' padding and static buffers (worker/engine/decode_graphs.py), checked on the CPU.

CUDA graphs need a GPU (tests/worker/test_cuda.py replays them there). What a replay reads and
writes does not: the step's rows copied into buffers sized for the largest bucket, padded up to the
bucket with rows that write into the cache's scratch block, with the window pool's tables beside
the main ones. DecodeGraphs(capture=False) runs exactly that forward eagerly, so these tests hold
its greedy tokens equal to the plain engine's while batches shrink through the buckets as
requests finish at different lengths.
"""

from __future__ import annotations

import pytest

from inferplane import LLM, SamplingParams
from inferplane.worker.engine.decode_graphs import DecodeGraphs, buckets
from inferplane.worker.ops.kv_cache import PagedKVCache
from tests.worker.conftest import prompts_of_lengths
from tests.worker.test_architectures import save_family


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert buckets(1) == [1]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = buckets(256)
    assert sizes[-1] == 256 and len(sizes) == 4 + 16
    for rows in range(1, 257):
        bucket = next(s for s in sizes if s >= rows)
        assert bucket - rows < max(16, rows)  # padding never doubles a batch past 16


def _with_uncaptured_graphs(llm: LLM) -> DecodeGraphs:
    """The engine's cache swapped for one with a scratch block, and decode graphs that run eagerly."""
    engine = llm.engine
    old = engine.cache
    window_blocks = old.window_data.shape[2] if old.window_data is not None else 0
    cache = PagedKVCache(num_blocks=old.num_blocks, num_window_blocks=window_blocks, scratch_block=True,
                         **engine.pools.cache_shape)
    engine.cache = engine.runner.cache = cache
    graphs = DecodeGraphs(engine.loaded.model, cache, engine.options.max_num_seqs, engine.max_model_len,
                          engine.pools.window, capture=False)
    engine.runner.graphs = graphs
    return graphs


def _run(path: str, graphs: bool, **options):
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=6, **options)
    runner = _with_uncaptured_graphs(llm) if graphs else None
    prompts = prompts_of_lengths([1, 5, 17, 33, 40, 3, 70, 12], vocab=320, seed=3)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], runner, llm


def test_padded_static_buffer_decode_equals_the_plain_engine(tiny_llama):
    expected, _, _ = _run(tiny_llama, graphs=False)
    got, graphs, llm = _run(tiny_llama, graphs=True)
    assert got == expected
    assert graphs.replays > 0
    assert llm.stats()["cuda_graph_steps"] == graphs.replays
    assert llm.engine.cache.data[:, :, llm.engine.cache.scratch].abs().sum() > 0  # padding rows wrote there


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> str:
    return save_family(tmp_path_factory.mktemp("gemma3-graphs"), "gemma3_text", seed=5)


def test_padded_decode_with_a_window_pool_equals_the_plain_engine(tiny_gemma3):
    expected, _, _ = _run(tiny_gemma3, graphs=False)
    got, graphs, llm = _run(tiny_gemma3, graphs=True)
    assert llm.engine.pools.window_layers  # the sliding layers' KV is in its own pool, with its own tables
    assert got == expected
    assert graphs.replays > 0


def test_a_table_wider_than_the_capture_is_refused(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_num_seqs=2)
    graphs = _with_uncaptured_graphs(llm)
    graphs.main.tables = graphs.main.tables[:, :1]
    llm.engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.step()  # the prefill runs eagerly
    with pytest.raises(ValueError, match="block table of 3 blocks"):
        llm.engine.step()
