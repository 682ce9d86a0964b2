"""n > 1: a request's choices compute the prompt once and fork its KV blocks.

The checks that could fail if the fork were wrong: greedy choices equal a lone request's output
(a wrongly copied partial block changes the next logits), seeded choice i equals a lone request
seeded with seed + i, and the block counter shows the prompt's whole blocks allocated once.
"""

from __future__ import annotations

import pytest

from inferplane.worker.engine.kv.block_pool import blocks_for
from inferplane.worker.engine.kv.manager import fork_layout
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.llm import LLM

from .conftest import prompts_of_lengths

BS = 8
RUNTIMES = ["paged", "radix", "cpu-int8"]


def _llm(path: str, runtime: str, **options) -> LLM:
    extra = {"skip_quality_gate": True} if runtime == "cpu-int8" else {}
    return LLM(path, runtime=runtime, device="cpu", block_size=BS, **{"num_kv_blocks": 64, **options, **extra})


@pytest.fixture(scope="module", params=RUNTIMES)
def llm(request, tiny_llama) -> LLM:
    return _llm(tiny_llama, request.param)


@pytest.mark.parametrize("prompt_len", [21, 17, 8])  # last token in a partial block, opening one, in the first
def test_greedy_choices_equal_a_lone_request_and_share_the_prompt_blocks(llm: LLM, prompt_len: int) -> None:
    prompt = prompts_of_lengths([prompt_len], 320, seed=prompt_len)[0]
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    lone = llm.generate([prompt], SamplingParams(**greedy), cache_salt=f"lone-{prompt_len}")[0]
    before = llm.stats()
    choices = llm.generate([prompt], SamplingParams(n=3, **greedy), cache_salt=f"fork-{prompt_len}")
    after = llm.stats()

    assert [c.token_ids for c in choices] == [lone.token_ids] * 3
    shared, partial = fork_layout(prompt_len, BS)
    computed = blocks_for(prompt_len + 6 - 1, BS)  # the last sampled token is never computed
    assert after["forked_sequences"] - before["forked_sequences"] == 2
    assert after["forked_shared_blocks"] - before["forked_shared_blocks"] == 2 * shared
    # The leader allocates every block it computes; each other choice all but the shared ones.
    allocated = after["blocks_allocated_total"] - before["blocks_allocated_total"]
    assert allocated == computed + 2 * (computed - shared)
    assert partial == (prompt_len % BS != 1)  # 8: nothing whole to share, 7 positions copied, not recomputed
    assert after["blocks_used"] == 0 or llm.engine.kv.name == "radix"


def test_seeded_choices_differ_and_each_is_reproducible(llm: LLM) -> None:
    prompt = prompts_of_lengths([13], 320, seed=99)[0]
    sampled = dict(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=True)
    choices = llm.generate([prompt], SamplingParams(n=3, seed=1234, **sampled), cache_salt="seeded")
    assert len({tuple(c.token_ids) for c in choices}) == 3
    for i, choice in enumerate(choices):
        alone = llm.generate([prompt], SamplingParams(seed=1234 + i, **sampled), cache_salt=f"seeded-{i}")[0]
        assert choice.token_ids == alone.token_ids
        assert choice.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_choices_without_a_free_slot_are_queued_and_still_answer(tiny_llama) -> None:
    llm = _llm(tiny_llama, "paged", max_num_seqs=2)
    prompt = prompts_of_lengths([11], 320, seed=5)[0]
    greedy = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    lone = llm.generate([prompt], SamplingParams(**greedy))[0]
    choices = llm.generate([prompt], SamplingParams(n=4, **greedy))
    stats = llm.stats()
    assert [c.token_ids for c in choices] == [lone.token_ids] * 4
    assert stats["forked_sequences"] == 1 and stats["fork_fallbacks"] == 2
    assert stats["blocks_used"] == 0


def test_choices_survive_preemption(tiny_llama) -> None:
    llm = _llm(tiny_llama, "paged", num_kv_blocks=7)  # 4 choices of 3 blocks each cannot all run
    prompt = prompts_of_lengths([12], 320, seed=6)[0]
    greedy = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    lone = llm.generate([prompt], SamplingParams(**greedy))[0]
    choices = llm.generate([prompt], SamplingParams(n=4, **greedy))
    assert [c.token_ids for c in choices] == [lone.token_ids] * 4
    assert llm.stats()["preemptions"] > 0 and llm.stats()["blocks_used"] == 0


def test_aborting_a_request_ends_every_choice_and_frees_their_blocks(tiny_llama) -> None:
    llm = _llm(tiny_llama, "paged")
    engine = llm.engine
    prompt = prompts_of_lengths([20], 320, seed=8)[0]
    leader = engine.add_request(prompt, SamplingParams(n=3, max_tokens=20, ignore_eos=True), request_id="r")
    engine.step()  # the prompt: the other choices are forked
    engine.step()
    assert engine.stats()["blocks_used"] > 0 and len(engine.group("r")) == 3
    outputs = engine.abort(leader.request_id)
    assert sorted(o.index for o in outputs) == [0, 1, 2] and all(o.finish_reason == "abort" for o in outputs)
    assert {o.request_id for o in outputs} == {"r"}
    assert engine.stats()["blocks_used"] == 0 and not engine.has_unfinished()


def test_n_out_of_range_names_the_field(tiny_llama) -> None:
    llm = _llm(tiny_llama, "paged")
    with pytest.raises(ValueError, match="^n:"):
        llm.generate([[1, 2, 3]], SamplingParams(n=0))


@pytest.mark.parametrize("runtime", ["paged", "radix"])
def test_prompt_logprobs_match_the_oracle_across_chunks_and_forks(tiny_llama, runtime: str) -> None:
    """Each prompt token's logprob given the tokens before it, with top alternatives, as HF
    transformers computes them; the prompt is prefilled in chunks of 8 and forked to a second choice."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = prompts_of_lengths([29], 320, seed=31)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    llm = _llm(tiny_llama, runtime, max_num_batched_tokens=8)
    cached = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # a radix hit would skip it
    assert cached[0].prompt_logprobs is None
    choices = llm.generate([prompt], SamplingParams(n=2, max_tokens=3, temperature=0.0, prompt_logprobs=2))
    for choice in choices:
        scored = choice.prompt_logprobs
        assert len(scored) == len(prompt) - 1
        for position, entry in enumerate(scored):
            expected = reference[position]
            assert entry.logprob == pytest.approx(expected[prompt[position + 1]].item(), abs=1e-3)
            values, ids = expected.topk(2)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-3)
    assert llm.stats()["forked_sequences"] == 1
