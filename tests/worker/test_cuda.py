"""The engine on a CUDA device: greedy tokens against HF transformers on the same device.

Skipped where there is no GPU (CI has none); run on a lent GPU machine with
``pytest tests/worker/test_cuda.py``. Float32 on CUDA may break a near-tie differently from HF
(other kernels, other reduction orders), so each sequence's agreement is the length of the prefix
it shares with HF's tokens; bfloat16 (the CUDA default dtype) is held to a looser floor.
"""

from __future__ import annotations

import pytest
import torch

from inferplane import LLM, SamplingParams
from tests.worker.conftest import hf_greedy, prompts_of_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [1, 3, 5, 8, 13, 16, 17, 31, 32, 33, 40, 50, 64, 70, 90, 100]
NEW_TOKENS = 24


def _agreement(ours: list[list[int]], expected: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before its first difference from the oracle."""
    shares = []
    for a, b in zip(ours, expected, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        shares.append(same / len(b))
    return sum(shares) / len(shares)


def _generate(path: str, prompts, dtype: str, **options) -> tuple[list[list[int]], dict]:
    llm = LLM(path, device="cuda", dtype=dtype, **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    return [o.token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("runtime", ["paged", "radix"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.95), ("bfloat16", 0.7)])
def test_greedy_agrees_with_hf_on_cuda(fixture, runtime, dtype, floor, request):
    path = request.getfixturevalue(fixture)
    prompts = prompts_of_lengths(LENGTHS, vocab=320, seed=7)
    expected = hf_greedy(path, prompts, NEW_TOKENS, device="cuda", dtype=getattr(torch, dtype))
    ours, stats = _generate(path, prompts, dtype, runtime=runtime)
    agreement = _agreement(ours, expected)
    exact = sum(a == b for a, b in zip(ours, expected, strict=True))
    print(f"{fixture} {runtime} {dtype}: agreement {agreement:.3f}, {exact}/{len(prompts)} sequences identical")
    assert agreement >= floor
    assert stats["blocks_used"] == 0 or runtime == "radix"


def test_preemption_and_chunked_prefill_on_cuda(tiny_llama):
    prompts = prompts_of_lengths(LENGTHS, vocab=320, seed=7)
    expected = hf_greedy(tiny_llama, prompts, NEW_TOKENS, device="cuda")
    ours, stats = _generate(tiny_llama, prompts, "float32", num_kv_blocks=16, block_size=8,
                            max_num_batched_tokens=48)
    assert stats["preemptions"] > 0
    assert _agreement(ours, expected) >= 0.95


def test_cuda_is_the_default_device_and_bfloat16_the_default_dtype(tiny_llama):
    llm = LLM(tiny_llama)
    assert llm.engine.device.type == "cuda"
    assert llm.engine.cache.data.dtype == torch.bfloat16
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
