"""Issue 17: penalties, logit_bias, min_tokens and top_logprobs in the sampler, against references
computed by hand (plain Python loops over the formulas OpenAI and vLLM document), and on the engine."""

from __future__ import annotations

import math

import pytest
import torch

from inferplane import LLM, SamplingParams
from inferplane.worker.engine.sampling import History, adjust_logits, sample

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.5, 0.0]


def reference(logits: list[float], p: SamplingParams, h: History) -> list[float]:
    out = list(logits)
    seen = set(h.prompt_ids) | set(h.output_ids)
    for t in seen:
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in range(len(out)):
        count = h.output_ids.count(t)
        out[t] -= count * p.frequency_penalty + (1 if count else 0) * p.presence_penalty
    for t, bias in p.logit_bias.items():
        out[t] += bias
    if len(h.output_ids) < p.min_tokens:
        for t in h.stop_ids:
            out[t] = -math.inf
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.4, presence_penalty=0.3),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(logit_bias={1: 5.0, 4: -100.0}),
    SamplingParams(min_tokens=5, max_tokens=10),
    SamplingParams(min_tokens=2, max_tokens=10, repetition_penalty=1.1, logit_bias={2: 1.0}),
])
def test_adjustments_match_the_documented_formulas(params: SamplingParams) -> None:
    history = History(prompt_ids=[0, 5, 5], output_ids=[3, 3, 1, 3], stop_ids=frozenset({4, 0}))
    logits = torch.tensor([LOGITS])
    adjust_logits(logits, [params], [history])
    assert logits[0].tolist() == pytest.approx(reference(LOGITS, params, history))


def test_rows_without_adjustments_are_untouched_and_batches_mix() -> None:
    plain, biased = SamplingParams(), SamplingParams(logit_bias={1: 10.0})
    history = History([0], [2], frozenset())
    logits = torch.tensor([LOGITS, LOGITS])
    adjust_logits(logits, [plain, biased], [history, history])
    assert logits[0].tolist() == LOGITS
    assert logits[1, 1].item() == pytest.approx(9.0)


def test_greedy_follows_the_bias_and_logprobs_stay_the_models() -> None:
    logits = torch.tensor([LOGITS])
    params = SamplingParams(temperature=0, logit_bias={4: 100.0}, top_logprobs=3, logprobs=True)
    result = sample(logits, [params], [0.5], True, [History([0], [], frozenset())])
    assert result.tokens == [4]
    raw = torch.tensor(LOGITS).log_softmax(-1)
    assert result.logprobs == pytest.approx([raw[4].item()])  # the model's own, before the bias
    ids = [t for t, _ in result.top[0]]
    assert ids == raw.topk(3).indices.tolist() and len(result.top[0]) == 3
    assert [lp for _, lp in result.top[0]] == pytest.approx(raw.topk(3).values.tolist())
    assert logits[0].tolist() == LOGITS  # the model's logits are not changed in place


def test_min_tokens_masks_stop_tokens_only_until_reached() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=5)
    logits = torch.tensor([LOGITS])  # argmax is 3
    early = sample(logits, [params], [0.5], False, [History([0], [1], frozenset({3}))])
    assert early.tokens == [0]  # 3 is a stop token and only one token was generated
    later = sample(logits, [params], [0.5], False, [History([0], [1, 2], frozenset({3}))])
    assert later.tokens == [3]


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(repetition_penalty=0), "repetition_penalty"),
    (SamplingParams(logit_bias={1: 101}), "logit_bias"),
    (SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
    (SamplingParams(top_logprobs=21), "top_logprobs"),
])
def test_out_of_range_values_name_their_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        params.validate(4, 64)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, device="cpu", num_kv_blocks=64, block_size=8)


PROMPT = [5, 17, 99, 3, 250, 42, 7]


def test_on_the_engine_a_bias_forces_a_token_and_a_penalty_breaks_repetition(llm: LLM) -> None:
    forced = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                   logit_bias={123: 100.0}))[0]
    assert forced.token_ids == [123] * 6
    penalised = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={123: 10.0},
                               frequency_penalty=2.0, presence_penalty=2.0)
    repeated = llm.generate([PROMPT], penalised)[0]
    # 123's adjusted logit is 10 - 2 * uses - 2 after its first use: by the fifth use it has lost
    # its whole bias, so other tokens take over.
    assert repeated.token_ids[0] == 123 and repeated.token_ids.count(123) <= 6


def test_on_the_engine_a_bad_bias_token_is_refused_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="^logit_bias:"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}))


def test_llm_returns_the_top_logprobs_it_was_asked_for(llm: LLM) -> None:
    """LLM.generate hands back top_logprobs (it took the parameter and dropped the alternatives before)."""
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True,
                                                top_logprobs=3))[0]
    assert len(out.top_logprobs) == len(out.token_ids) == 4
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3 and top[0] == (token, pytest.approx(logprob))  # greedy: the best is the choice
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, logprobs=True))[0]
    assert plain.top_logprobs is None
