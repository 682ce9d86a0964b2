"""Every decoder family served equals transformers (the oracle) on a small random checkpoint built
and saved by transformers itself, in float32: greedy tokens for prompts of many lengths submitted
together, under chunked prefill and preemption, and from the radix prefix cache; the logprobs of
the chosen tokens within 1e-4 of transformers' log-softmax.

The configs are shrunk so every family feature is exercised by prompts of up to 100 tokens: a
sliding window of 16 (so windows bind in prefill, in decode and across cached prefixes), soft-caps
small enough to bend the scores (Gemma 2), routers over 4 experts (MoE), LongRoPE factors far from
1 (Phi-3), and norm weights drawn at random (so Gemma's (1 + w) and the query/key norms matter).
"""

from __future__ import annotations

import pytest
import torch

from inferplane import LLM, SamplingParams
from tests.worker.conftest import hf_greedy, prompts_of_lengths

LENGTHS = [1, 3, 8, 13, 17, 31, 33, 50, 70, 100]
NEW_TOKENS = 20
VOCAB = 320

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15,
              eos_token_id=None, bos_token_id=None, pad_token_id=0)

FAMILIES = {
    "qwen3": dict(rope_theta=100000.0, tie_word_embeddings=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "gemma2": dict(sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(sliding_window=16, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(original_max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.25 * i for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 256}),
    "phi3_window": dict(sliding_window=16),
}


def save_family(path, family: str, seed: int, **overrides) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model_type = "phi3" if family.startswith("phi3") else family
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[family], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # HF starts these at 1 (or 0 for Gemma): make them matter
                param.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)
            elif "gate.weight" in name and "experts" not in name:  # routers: decisive choices
                param.normal_(0.0, 1.0)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    family = request.param
    return family, save_family(tmp_path_factory.mktemp(family), family, seed=len(family))


def _greedy(path: str, prompts, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, device="cpu", dtype="float32", **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    return [o.token_ids for o in outs], llm


def test_greedy_tokens_equal_transformers_batched_chunked_and_from_the_prefix_cache(family_checkpoint):
    family, path = family_checkpoint
    prompts = prompts_of_lengths(LENGTHS, vocab=VOCAB, seed=11)
    expected = hf_greedy(path, prompts, NEW_TOKENS)

    together, _ = _greedy(path, prompts)
    assert together == expected, f"{family}: all prompts in one batch"

    # 24 blocks of 8 tokens and a 48-token step budget: long prompts are chunked and requests preempted
    chunked, llm = _greedy(path, prompts, num_kv_blocks=24, block_size=8, max_num_batched_tokens=48)
    assert llm.stats()["preemptions"] > 0
    assert chunked == expected, f"{family}: chunked prefill and preemption"

    # the radix runtime: a second round of the same prompts reads their prefixes from the cache
    llm = LLM(path, device="cpu", dtype="float32", runtime="radix", block_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == expected, f"{family}: radix"
    assert [o.token_ids for o in again] == expected, f"{family}: radix from cached prefixes"
    assert sum(o.num_cached_tokens for o in again) > 0


def test_chosen_token_logprobs_are_within_1e_4_of_transformers(family_checkpoint):
    from transformers import AutoModelForCausalLM

    family, path = family_checkpoint
    prompt = prompts_of_lengths([40], vocab=VOCAB, seed=5)[0]
    llm = LLM(path, device="cpu", dtype="float32")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    rows = range(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
    expected = [reference[r, t].item() for r, t in zip(rows, out.token_ids, strict=True)]
    ours = [lp if isinstance(lp, float) else lp.logprob for lp in out.logprobs]
    assert ours == pytest.approx(expected, abs=1e-4), family


def test_cpu_int8_smoothing_keeps_each_family_and_converts_every_linear_experts_included(family_checkpoint):
    """cpu-int8 on each family: smoothing folds into the norm that really feeds each linear (Gemma's
    pre-feedforward norm, not its post-attention one) so the float model is unchanged; then every
    linear, each expert's too, becomes int8 but a MoE layer's router, and the logits stay close to
    float's."""
    from torch import nn

    from inferplane.worker.model.loader import load_model
    from inferplane.worker.quant.convert import convert_model
    from inferplane.worker.quant.gate import sequence_logits
    from inferplane.worker.quant.smooth import input_absmax, smooth_llama

    family, path = family_checkpoint
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    ids = prompts_of_lengths([40], VOCAB, seed=9)[0]
    before = sequence_logits(loaded.model, ids)
    smooth_llama(loaded.model, input_absmax(loaded.model, ids), alpha=0.5)
    torch.testing.assert_close(sequence_logits(loaded.model, ids), before, rtol=1e-4, atol=1e-4)

    convert_model(loaded.model, measure_dispatch=False)
    still_float = [n for n, m in loaded.model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    routers = [n for n, m in loaded.model.named_modules() if hasattr(m, "experts")]
    assert still_float == [f"{n}.gate" for n in routers], family  # only MoE routers stay float32
    after = sequence_logits(loaded.model, ids)
    cosine = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0).item()
    assert cosine >= 0.99, f"{family}: int8 logits cosine {cosine:.4f} against float"
