"""Property: after every request finishes or is aborted, no KV block is in use and the pool's
reference counts are back to zero, whatever the arrivals, aborts and pool size."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferplane.worker.engine.engine import Engine
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.model.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    import torch

    return load_model(tiny_llama, torch.device("cpu"), torch.float32)


request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 8)),  # abort at step (None: runs to the end)
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=10), num_blocks=st.integers(7, 24),
       budget=st.sampled_from([8, 16, 64]), max_seqs=st.integers(1, 6))
def test_blocks_all_return_to_the_pool(loaded, requests, num_blocks, budget, max_seqs):
    options = EngineOptions(num_kv_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                            max_num_seqs=max_seqs)
    import torch

    engine = Engine(loaded, options, torch.device("cpu"), torch.float32)
    ids: dict[int, str] = {}
    for step in range(200):
        for i, (plen, max_tokens, arrive, _) in enumerate(requests):
            if arrive == step:
                prompt = [(i * 7 + j) % 300 for j in range(plen)]
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                if -(-(plen + max_tokens) // 4) > num_blocks:  # could never fit: refused up front
                    with pytest.raises(ValueError, match="KV blocks"):
                        engine.add_request(prompt, params)
                    continue
                ids[i] = engine.add_request(prompt, params).request_id
        for i, (*_, abort_at) in enumerate(requests):
            if abort_at == step and i in ids:
                engine.abort(ids[i])
        engine.step()
        pool = engine.kv.pool
        assert all(c >= 0 for c in pool.ref_counts)
        assert pool.num_used == sum(1 for c in pool.ref_counts if c > 0)
        if step > 8 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.stats()["blocks_used"] == 0
    assert all(c == 0 for c in engine.kv.pool.ref_counts)
    assert engine.kv.peak_blocks_used <= num_blocks
