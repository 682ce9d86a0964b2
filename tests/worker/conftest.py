"""Tiny random Llama and Qwen2 checkpoints (saved by HF transformers as safetensors), shared by
the worker tests. HF transformers is the correctness oracle."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_tiny(path, arch: str, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.15, eos_token_id=None, bos_token_id=None)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, tie_word_embeddings=False, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=100000.0, tie_word_embeddings=True, **common))
        with torch.no_grad():  # give the q/k/v biases values the test can see
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2)


def prompts_of_lengths(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model_path_or_module, prompts: list[list[int]], max_new_tokens: int, *, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """The oracle: HF transformers' own greedy decoding, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = model_path_or_module
    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
            outs.append(gen[0, len(p):].tolist())
    return outs


def one_kernel_for_every_row_count(llm):
    """`llm` (cpu-int8) with one kernel for every row count: tests that compare runs need it.

    cpu-int8 runs a linear of many rows as float32 GEMM over the dequantized weight from the row
    count its start-up measurement found faster, and fewer rows on the int8 kernel: a 37-row prefill
    and the 5 rows a cache hit leaves (or two engines measuring apart) can then take different
    kernels, further apart than rounding (0.24 in logprob, seen once on a loaded machine, where the
    measured crossover fell below 37). So every row count takes the int8 kernel, as the quality gate
    measures it (Int8Dispatch.int8_only); layers left unpacked quantize every row count's
    activations (their measured weight-only/dynamic crossover is pinned the same way)."""
    for module in llm.engine.loaded.model.modules():
        dispatch = getattr(module, "dispatch", None)
        if dispatch is not None:
            dispatch.float_from, dispatch.thresholds, dispatch.default_min_rows = {}, {}, 1
            dispatch.version += 1
    return llm
