"""Bursts of decode steps in one C call (engine/decode_bursts.py, native ip_decode_steps): the tokens
single steps give, greedy and sampled (each row's draws are its own key's at each position, in
both), a stop inside a burst ending the request where single steps end it, and no burst where one
would change what a request gets or make a waiting request wait longer."""

from __future__ import annotations

import pytest

from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.llm import LLM
from tests.worker.conftest import one_kernel_for_every_row_count, prompts_of_lengths
from tests.worker.test_fused_decode import tiny_gemma3  # noqa: F401 (the fixture: sliding layers, window pool)

GREEDY = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True)  # 37: bursts cut at block ends
SAMPLED = SamplingParams(max_tokens=37, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)


def _llm(path: str, steps: int, **options) -> LLM:
    # step_target_ms=0 and one kernel for every row count: both engines batch and compute the
    # prompts alike, so only the decode steps differ (test_fused_decode's _llm says why).
    return one_kernel_for_every_row_count(
        LLM(path, runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True, step_target_ms=0,
            decode_steps=steps, **options))


def _bursts(llm: LLM) -> float:
    return llm.engine.stats()["decode_burst_steps_total"]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kv_manager", ["paged", "radix"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
def test_bursts_give_the_tokens_of_single_steps(model, kv_manager, params, request):
    """Three sequences decoding together (one row finishing its prompt later), across block ends
    and, on Gemma 3's sliding layers, past their window of 16 in the window pool; the radix runtime
    then serves the prompts from its cache and decodes again. Sampled rows draw in the burst's C
    call what single steps draw."""
    path = request.getfixturevalue(model)
    prompts = prompts_of_lengths([5, 16, 23], vocab=320, seed=3)
    single, burst = _llm(path, 1, kv_manager=kv_manager), _llm(path, 8, kv_manager=kv_manager)
    for _ in range(2):
        expected = [o.token_ids for o in single.generate(prompts, params)]
        assert [o.token_ids for o in burst.generate(prompts, params)] == expected
    assert _bursts(single) == 0
    assert _bursts(burst) > 0
    assert burst.engine.stats()["generation_tokens_total"] == single.engine.stats()["generation_tokens_total"]


def test_a_stop_inside_a_burst_ends_the_request_where_single_steps_end_it(tiny_llama):
    prompt = prompts_of_lengths([7], vocab=320, seed=5)
    single, burst = _llm(tiny_llama, 1), _llm(tiny_llama, 8)
    free = single.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    stop = free[11]
    end = free.index(stop)
    for llm in (single, burst):
        stopped = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop]))[0]
        assert (stopped.token_ids, stopped.finish_reason) == (free[:end + 1], "stop")  # the stop token counted
        capped = llm.generate(prompt, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True))[0]
        assert (capped.token_ids, capped.finish_reason) == (free[:13], "length")
        assert llm.engine.stats()["blocks_used"] == 0  # every block back, the burst's last one too
    assert _bursts(burst) > 0


@pytest.mark.slow
def test_a_stop_string_inside_a_burst_cuts_the_text_where_single_steps_cut_it():
    """SmolLM2 (a tokenizer): the stop string is found in the text of a token in a burst's middle."""
    single, burst = _llm("smollm2-135m", 1), _llm("smollm2-135m", 8)
    prompt = "The three primary colors are"
    free = single.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 4]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    expected = single.generate([prompt], params)[0]
    got = burst.generate([prompt], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (expected.text, expected.token_ids, "stop")
    assert stop not in got.text and free.text.startswith(got.text)
    assert got.stop_reason == expected.stop_reason == stop  # which stop string ended it
    assert free.stop_reason is None
    assert _bursts(burst) > 0


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0.8, seed=1, logprobs=True),
    SamplingParams(max_tokens=20, temperature=0, logprobs=True),
    SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5),
], ids=["sampled-logprobs", "logprobs", "penalty"])
def test_no_burst_where_the_logits_alone_do_not_choose_the_token(tiny_llama, params):
    llm = _llm(tiny_llama, 8)
    outs = llm.generate(prompts_of_lengths([6, 9], vocab=320, seed=1), params)
    assert all(len(o.token_ids) == 20 for o in outs)
    assert _bursts(llm) == 0


def test_no_burst_while_a_request_waits_to_be_admitted(tiny_llama):
    """One slot: while the second request waits, the first decodes a step at a time; alone, the
    second decodes in bursts."""
    llm = _llm(tiny_llama, 8, max_num_seqs=1)
    engine = llm.engine
    first, second = prompts_of_lengths([6, 9], vocab=320, seed=2)
    engine.add_request(first, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), request_id="a")
    engine.add_request(second, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), request_id="b")
    finished = set()
    while "a" not in finished:
        finished |= {out.request_id for out in engine.step() if out.finished}
        assert _bursts(llm) == 0
    while engine.has_unfinished():
        engine.step()
    assert _bursts(llm) > 0


def test_a_burst_past_a_rows_block_is_refused(tiny_llama):
    """The engine keeps each burst inside the block each row's next token goes to; asked for 12 steps
    (the longer row has room for 15, the shorter for 10), the C call refuses rather than write into
    another block (here the block the shorter row's padded table names)."""
    llm = _llm(tiny_llama, 8, kv_manager="paged")
    engine = llm.engine
    for prompt in prompts_of_lengths([6, 33], vocab=320, seed=4):
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()  # the prompts
    plan = engine.scheduler.schedule()
    assert [len(item.seq.block_table) for item in plan.scheduled] == [1, 3]
    with pytest.raises(RuntimeError, match="outside the block its row's first token went to"):
        engine.runner.execute(plan.scheduled, 12)


def test_a_row_stopping_ends_the_burst_for_the_rows_beside_it(tiny_llama):
    """A row's stop token ends the burst after that step: single steps go on without the row, and
    the attention splits a long context by the number of rows, so the other row's later tokens are
    computed as single steps compute them (without this, the row beside it differed at its 52nd
    token)."""
    long_a, long_b = prompts_of_lengths([200, 260], vocab=320, seed=9)
    free = _llm(tiny_llama, 1, kv_manager="paged").generate(
        [long_a], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    params = [SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, stop_token_ids=[free[1]]),
              SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)]
    runs = []
    for steps in (1, 8):
        llm = _llm(tiny_llama, steps, kv_manager="paged")
        engine = llm.engine
        for prompt, p in zip((long_a, long_b), params, strict=True):
            engine.add_request(prompt, p)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        runs.append((tokens, _bursts(llm)))
    (single, _), (burst, burst_steps) = runs
    assert burst == single and burst_steps > 0
    assert min(len(t) for t in single.values()) < 8 < max(len(t) for t in single.values())


def test_a_requests_first_token_is_not_held_back_by_a_burst(tiny_llama):
    """A prompt served from the prefix cache but its last token computes one token, like a 1-token
    prefill chunk: its first output goes out alone, not after a burst."""
    llm = _llm(tiny_llama, 8, kv_manager="radix")
    engine = llm.engine
    prompt = prompts_of_lengths([17], vocab=320, seed=8)[0]
    llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), request_id="again")
    hits = engine.stats()["prefix_hit_tokens"]
    first = [out for out in engine.step() if out.request_id == "again"]
    assert engine.stats()["prefix_hit_tokens"] - hits == 16  # one block from the cache, one token computed
    assert [len(out.new_token_ids) for out in first] == [1]
    while engine.has_unfinished():
        engine.step()
    assert _bursts(llm) > 0


def test_a_burst_takes_no_longer_than_a_step_is_meant_to(tiny_llama):
    """With step_target_ms, the measured decode step time caps a burst: a model whose steps take
    0.2 s bursts two at a 500 ms target, none at 150 ms, and none before a step was measured."""
    llm = _llm(tiny_llama, 8)
    engine = llm.engine
    engine.options.step_target_ms = 500
    engine.add_request(prompts_of_lengths([3], vocab=320, seed=6)[0],
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()  # the prompt (the next token's position is 3: 13 more fit in its block)
    plan = engine.scheduler.schedule()
    bursts = engine.bursts
    bursts.decode_step_s = None
    assert bursts.steps_for(plan.scheduled, someone_waiting=False) == 1
    bursts.decode_step_s = 0.2
    assert bursts.steps_for(plan.scheduled, someone_waiting=False) == 2
    bursts.decode_step_s = 0.3
    assert bursts.steps_for(plan.scheduled, someone_waiting=False) == 1
    engine.options.step_target_ms = 0  # off: the block, max_tokens and decode_steps bound it
    assert bursts.steps_for(plan.scheduled, someone_waiting=False) == 8
