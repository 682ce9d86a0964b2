"""Sampling, stop conditions, validation and abort on the engine, with a tiny random Llama."""

from __future__ import annotations

import pytest

from inferplane import LLM, SamplingParams
from inferplane.api.model_config import ModelLoadError


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, device="cpu", num_kv_blocks=64, block_size=8)


PROMPT = [5, 17, 99, 3, 250, 42, 7]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True) for _ in range(3)]
    crowded = llm.generate([[1, 2], PROMPT, [9] * 30, [4, 4, 4]], [others[0], params, others[1], others[2]])
    assert crowded[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    assert llm.generate([PROMPT], other_seed)[0].token_ids != alone


def test_top_k_one_is_greedy_and_logprobs_are_reported(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3,
                                                 ignore_eos=True, logprobs=True))[0]
    assert top1.token_ids == greedy.token_ids
    assert len(top1.logprobs) == 10 and all(lp <= 0 for lp in top1.logprobs)


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=10_000), "max_tokens"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_k=-2), "top_k"),
    ],
)
def test_bad_parameters_name_the_field(llm, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPT], params)
    assert llm.stats()["num_waiting"] == 0  # nothing half-submitted


def test_bad_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=2))  # past the 512-token context
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 100_000]], SamplingParams(max_tokens=2))


def test_one_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(ValueError):
        llm.generate([PROMPT, []], SamplingParams(max_tokens=2))
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["blocks_used"] == 0


def test_a_request_that_can_never_fit_fails_clearly(tiny_llama):
    small = LLM(tiny_llama, device="cpu", num_kv_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[1] * 20], SamplingParams(max_tokens=20))


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    seq = engine.add_request(PROMPT * 4, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["blocks_used"] > 0
    [out] = engine.abort(seq.request_id)
    assert out.finished and out.finish_reason == "abort"
    assert engine.stats()["blocks_used"] == 0 and not engine.has_unfinished()


def test_missing_and_corrupt_models_fail_with_a_reason(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        LLM(str(bad))


def test_unknown_engine_option_is_named(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_llama, max_num_seq=4)


def test_step_budget_follows_measured_step_time_and_never_starves_decodes():
    from inferplane.worker.engine.step_budget import INITIAL_TOKENS, MIN_TOKENS, StepBudget

    budget = StepBudget(max_tokens=2048, target_s=0.5)
    assert budget.tokens() == INITIAL_TOKENS  # nothing measured yet
    budget.observe(prefill_tokens=0, total_tokens=8, seconds=5.0)  # a decode step: not a measurement
    assert budget.tokens() == INITIAL_TOKENS
    budget.observe(prefill_tokens=256, total_tokens=256, seconds=2.56)  # 10 ms a token
    assert budget.tokens() == 50
    budget.observe(prefill_tokens=256, total_tokens=256, seconds=0.0256)  # much faster now: grows
    assert 50 < budget.tokens() <= 2048
    budget.seconds_per_token = 1.0  # a very slow CPU
    assert budget.tokens() == MIN_TOKENS
    assert budget.tokens_for(running=100) == 100 + MIN_TOKENS  # every decode still fits
    assert StepBudget(max_tokens=2048, target_s=0).tokens() == 2048  # sizing off: the fixed maximum


def test_a_long_prompt_is_chunked_while_running_sequences_keep_decoding(tiny_llama):
    """A step target far below what a step takes: the long prompt arrives in MIN_TOKENS-sized
    chunks and the sequence already running gets a token at every one of those steps."""
    from inferplane.worker.engine.step_budget import MIN_TOKENS

    llm = LLM(tiny_llama, device="cpu", num_kv_blocks=128, step_target_ms=1)
    engine = llm.engine
    short = engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(3):
        engine.step()  # prefill (40 tokens: measured), then decoding
    long_prompt = [(i * 7) % 200 + 3 for i in range(400)]
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    steps = 0
    while long.num_computed_tokens < len(long_prompt):
        before_short, before_long = len(short.output_token_ids), long.num_computed_tokens
        engine.step()
        steps += 1
        assert len(short.output_token_ids) == before_short + 1  # never held back by the prompt
        assert long.num_computed_tokens - before_long <= MIN_TOKENS + 1
    assert steps >= len(long_prompt) // (MIN_TOKENS + 1)
