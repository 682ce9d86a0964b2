"""Issue 17: top_logprobs, completions logprobs N with text_offset, logit_bias and penalties through
the whole path (official `openai` client -> gateway -> worker), on the tiny model."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.slow


@pytest.fixture
def client(in_process_gateway) -> AsyncOpenAI:
    return openai_client(in_process_gateway, "s")


MESSAGES = [{"role": "user", "content": "Say something"}]


async def test_chat_top_logprobs_lists_the_best_alternatives_of_each_token(client) -> None:
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0,
                                                  logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy, nothing adjusted: the chosen token is the best alternative.
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(values[0])


async def test_streamed_chunks_carry_their_tokens_top_logprobs(client) -> None:
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0,
                                                  logprobs=True, top_logprobs=2, stream=True)
    entries = [e async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content]
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


async def test_completions_logprobs_n_gives_top_entries_and_text_offsets(client) -> None:
    answer = await client.completions.create(model="m", prompt="Once upon", max_tokens=6, temperature=0, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert all(len(top) <= 2 and top for top in logprobs.top_logprobs)  # two ids may decode alike
    offsets, position = [], 0
    for token in logprobs.tokens:
        offsets.append(position)
        position += len(token)
    assert logprobs.text_offset == offsets


async def test_logit_bias_forces_a_token_the_model_would_never_pick(client) -> None:
    plain = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0,
                                                 logprobs=True)
    forced = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0,
                                                  logit_bias={"123": 100}, logprobs=True, top_logprobs=1)
    content = forced.choices[0].logprobs.content
    assert len({e.token for e in content}) == 1 and content[0].token != plain.choices[0].logprobs.content[0].token
    # The reported logprobs are the model's: far below the best alternative the bias overrode.
    assert all(e.logprob < e.top_logprobs[0].logprob - 10 for e in content)


def test_the_grpc_api_carries_every_sampling_field_into_the_same_validation() -> None:
    from inferplane.control_plane.gateway.grpc_api import rest_body
    from inferplane.v1 import worker_pb2

    params = worker_pb2.SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=-0.5,
                                       repetition_penalty=1.2, min_tokens=2, logprobs=True, top_logprobs=3,
                                       logit_bias={7: -5.0})
    chat = rest_body("m", params, messages=[{"role": "user", "content": "hi"}])
    mapped = chat.sampling_params(4)
    assert (mapped.presence_penalty, mapped.frequency_penalty, mapped.min_tokens, mapped.top_logprobs) == \
        (0.5, -0.5, 2, 3)
    assert mapped.repetition_penalty == pytest.approx(1.2) and dict(mapped.logit_bias) == {7: -5.0}
    text = rest_body("m", params, prompt="hi")
    assert text.sampling_params(4).top_logprobs == 3


async def test_a_prompt_of_token_ids_answers_as_its_text_does(client, in_process_gateway) -> None:
    tokenizer = in_process_gateway.catalog.get("m", None).tokenizer
    ids = tokenizer.encode("Once upon a time")
    by_text = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0)
    by_ids = await client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    nested = await client.completions.create(model="m", prompt=[ids], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == nested.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_echo_puts_the_prompt_first_whole_and_streamed(client) -> None:
    plain = await client.completions.create(model="m", prompt="Once upon", max_tokens=5, temperature=0)
    echoed = await client.completions.create(model="m", prompt="Once upon", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    stream = await client.completions.create(model="m", prompt="Once upon", max_tokens=5, temperature=0, echo=True,
                                             stream=True)
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert streamed == echoed.choices[0].text


async def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(client) -> None:
    """The prompt's tokens come first in the logprobs (the first with none), each scored given the
    tokens before it: so the logprob echoed for a generated token, fed back as prompt, is the one
    it was sampled with."""
    first = await client.completions.create(model="m", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
    generated = first.choices[0].logprobs
    whole = "Once upon" + first.choices[0].text
    echoed = await client.completions.create(model="m", prompt=whole, max_tokens=1, temperature=0, logprobs=2,
                                             echo=True)
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(whole)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    prompt_tokens = echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 1 and all(v is not None for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[:prompt_tokens]) == whole
    # The last 4 prompt tokens are the 4 generated ones (same text, same tokens, greedy): same scores.
    assert logprobs.token_logprobs[prompt_tokens - 4:prompt_tokens] == pytest.approx(generated.token_logprobs, abs=1e-3)
    assert logprobs.text_offset[:prompt_tokens] == [len("".join(logprobs.tokens[:i])) for i in range(prompt_tokens)]
    stream = await client.completions.create(model="m", prompt=whole, max_tokens=1, temperature=0, logprobs=2,
                                             echo=True, stream=True)
    streamed = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs]
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-6)


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [10**7]}, "prompt"),  # outside the vocabulary: the worker names it
])
async def test_prompts_it_cannot_serve_are_400s(client, extra, param) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="m", max_tokens=2, **{"prompt": "hi", **extra})
    assert refused.value.body["param"] == param, refused.value.body
