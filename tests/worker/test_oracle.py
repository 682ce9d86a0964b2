"""Greedy outputs equal HF transformers (the oracle) on the same weights."""

from __future__ import annotations

import pytest
import torch

from inferplane import LLM, SamplingParams
from tests.worker.conftest import hf_greedy, prompts_of_lengths

LENGTHS = [1, 3, 5, 8, 13, 16, 17, 31, 32, 33, 40, 50, 64, 70, 90, 100]  # 16 prompts, every block alignment
NEW_TOKENS = 24


def _ours(path: str, prompts, **options) -> tuple[list[list[int]], dict]:
    llm = LLM(path, device="cpu", dtype="float32", **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    return [o.token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_greedy_matches_hf_with_all_prompts_submitted_together(fixture, request):
    path = request.getfixturevalue(fixture)
    prompts = prompts_of_lengths(LENGTHS, vocab=320, seed=7)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    ours, stats = _ours(path, prompts)
    assert ours == expected
    assert stats["blocks_used"] == 0


def test_greedy_matches_hf_under_preemption_and_chunked_prefill(tiny_llama):
    prompts = prompts_of_lengths(LENGTHS, vocab=320, seed=7)
    expected = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    # 16 blocks of 8 tokens: the longest request alone needs 16, so the batch must preempt;
    # a 48-token budget splits the long prompts into chunks.
    ours, stats = _ours(tiny_llama, prompts, num_kv_blocks=16, block_size=8, max_num_batched_tokens=48)
    assert stats["preemptions"] > 0
    assert stats["peak_blocks_used"] <= 16
    assert ours == expected


@pytest.mark.slow
def test_smollm2_gguf_matches_hf_loading_the_same_file():
    from transformers import AutoModelForCausalLM

    from inferplane.api.model_resolution import builtin_model_path

    smollm2 = builtin_model_path("smollm2-135m")
    folder, SMOLLM2_FILE = str(smollm2.parent), smollm2.name
    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "1, 2, 3, 4,", "The chemical symbol for gold is", "Dear Sir or Madam,", "import numpy as np\n",
             "Water boils at", "The three primary colors are", "Q: What is 7 times 8?\nA:",
             "In 1969, astronauts", "My favourite food is", "The quick brown fox", "Python is a",
             "Translate to French: cheese =>", "Roses are red,"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    expected = hf_greedy(hf, prompts, 16)
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text
