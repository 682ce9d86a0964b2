"""A float16 KV cache under float32 compute (kv_cache_dtype): twice the blocks in the same memory,
outputs close to a float32 cache's, and a prompt that computes the same however it was computed:
in one chunk or several, from the prefix cache, or forked for n > 1 (prefill attends to this step's
keys and values rounded as the cache holds them)."""

from __future__ import annotations

import pytest
import torch

from inferplane.worker.llm import LLM
from inferplane.worker.sampling import SamplingParams
from tests.worker.conftest import prompts_of_lengths

RUNTIMES = ["paged", "cpu-int8"]  # PyTorch's attention over the gathered cache; the C kernels
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)


def _llm(path: str, runtime: str, **options) -> LLM:
    extra = {"skip_quality_gate": True} if runtime == "cpu-int8" else {}
    return LLM(path, runtime=runtime, device="cpu", **{"num_kv_blocks": 64, **extra, **options})


def _run(llm: LLM, prompts, params=GREEDY) -> list[tuple[list[int], list[float]]]:
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_float16_cache_holds_twice_the_blocks_in_the_same_memory(tiny_llama, runtime):
    blocks = {}
    for dtype in ("float32", "float16"):
        llm = _llm(tiny_llama, runtime, num_kv_blocks=None, kv_cache_memory="1MiB", kv_cache_dtype=dtype)
        assert llm.engine.cache.data.dtype == getattr(torch, dtype)
        blocks[dtype] = llm.engine.kv.num_blocks
    assert blocks["float16"] == 2 * blocks["float32"]
    assert _llm(tiny_llama, runtime).engine.cache.data.dtype == torch.float32  # auto: the compute dtype


def test_a_float16_cache_scores_a_prompt_as_a_float32_one_within_its_rounding(tiny_llama):
    """Prompt logprobs, prefilled in chunks of 8 so that each chunk attends to the earlier ones as the
    cache holds them, and decoding's first tokens: close to a float32 cache's, and rounded. (On int8
    weights, where each row's activations are quantized, SmolLM2's perplexity is the measure: below.)"""
    prompts = prompts_of_lengths([23, 41], 320, seed=11)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=0)
    runs = {dtype: _llm(tiny_llama, "paged", kv_cache_dtype=dtype, max_num_batched_tokens=8).generate(prompts, params)
            for dtype in ("float32", "float16")}
    wide, narrow = ([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]] + [lp for o in outs for lp in o.logprobs]
                    for outs in runs.values())
    assert [o.token_ids for o in runs["float16"]] == [o.token_ids for o in runs["float32"]]
    assert narrow == pytest.approx(wide, abs=2e-2)
    assert narrow != wide  # it did round


@pytest.mark.slow
def test_smollm2s_perplexity_with_a_float16_cache(capsys):
    """cpu-int8 SmolLM2 scoring the evaluation text in chunks of 64 tokens, each chunk attending to
    the earlier ones through the cache: a float16 cache moves the perplexity by well under the
    quality gate's 2% (measured: see the print)."""
    import math

    from inferplane.worker.quant.gate import load_eval_text

    ppl = {}
    for dtype in ("float32", "float16"):
        llm = LLM("smollm2-135m", runtime="cpu-int8", device="cpu", kv_cache_dtype=dtype, max_num_batched_tokens=64,
                  num_kv_blocks=96)
        ids = llm.engine.tokenize(load_eval_text())[:1024]
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
        scored = [lp.logprob for lp in out.prompt_logprobs[1:]]
        ppl[dtype] = math.exp(-sum(scored) / len(scored))
    rise = ppl["float16"] / ppl["float32"] - 1
    with capsys.disabled():
        print(f"\nSmolLM2 cpu-int8 perplexity, chunks of 64: float32 cache {ppl['float32']:.3f}, "
              f"float16 cache {ppl['float16']:.3f} ({rise:+.3%})")
    assert abs(rise) < 0.01


# cpu-int8 on the random tiny model: two LLM instances, or a fork's one-row recompute of the last
# prompt token against a prefill row, round each row's activations to int8 after float sums taken in
# another order, and the model's near-uniform logits turn such re-rolls into other tokens. Measured on
# an AMD EPYC with AVX2 kernels (issue 32), native kernels on or off: the two greedy choices of one
# forked prompt disagreed with each other (124 and 84), and the fresh run's second prompt gave 208
# in one run and 130 in another, while with a float32 cache fork and fresh agreed exactly. Kept
# running, not asserted, until issue 32 settles what cpu-int8 promises here.
INT8_NEAR_TIES = pytest.mark.xfail(strict=False, reason=(
    "cpu-int8 re-rolls near ties of the random tiny model across instances and row counts on some CPUs "
    "(AMD EPYC, AVX2): issue 32"))


@pytest.mark.parametrize("runtime", ["paged", pytest.param("cpu-int8", marks=INT8_NEAR_TIES)])
def test_a_prompt_computes_the_same_from_the_prefix_cache_or_forked(tiny_llama, runtime):
    """A prompt's prefill attends to its own keys and values rounded as the cache holds them, so a
    radix cache hit and an n > 1 fork, which read them from the cache, give what computing it gave
    (without that rounding: up to 1.9 apart in logprob, tokens differing)."""
    prompts = prompts_of_lengths([37, 50], 320, seed=14)
    paged = {"kv_manager": "paged"} if runtime == "cpu-int8" else {}
    whole = _run(_llm(tiny_llama, runtime, kv_cache_dtype="float16", **paged), prompts)
    radix = (_llm(tiny_llama, "radix", kv_cache_dtype="float16") if runtime == "paged"
             else _llm(tiny_llama, runtime, kv_cache_dtype="float16", kv_manager="radix"))
    _run(radix, prompts)
    cached = _run(radix, prompts)
    assert radix.stats()["prefix_hit_tokens"] > 0
    forked = [(o.token_ids, o.logprobs) for o in _llm(tiny_llama, runtime, kv_cache_dtype="float16", **paged).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True, n=2))]
    for name, other in (("cached", cached), ("forked", forked[::2]), ("forked", forked[1::2])):
        for (tokens, logprobs), (tokens_o, logprobs_o) in zip(whole, other, strict=True):
            assert tokens_o == tokens, name
            assert logprobs_o == pytest.approx(logprobs, abs=1e-4), name
