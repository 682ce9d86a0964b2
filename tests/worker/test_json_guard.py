"""Issue 53: no JSON object of a structured output repeats a key (worker/structured/json_guard.py),
and a forced tool call's arguments take only the keys the function declares (gateway call_schema).

Checked on two real tokenizers (the tiny model's byte-level one, where a key closes only with a
lone quote, and SmolLM2's 49k BPE, where `":`, `",` and friends close it too), with token
sequences forced through the matcher and with a "stubborn" sampler that prefers repeating a key,
and on SmolLM2 itself (cpu-int8) with the forced call that ran away in the issue.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from inferplane.control_plane.gateway.structured_outputs import Tool, call_schema  # noqa: E402
from inferplane.worker.structured import Constraint, GrammarCompiler, apply_masks, fill_bitmasks  # noqa: E402
from inferplane.worker.structured.json_guard import MAX_NUMBER_CHARS  # noqa: E402
from tests.worker.test_structured import _load  # noqa: E402

OPEN_SCHEMAS = [  # every one lets undeclared keys in somewhere
    None,  # json_object
    {"type": "object", "properties": {"location": {"type": "string", "maxLength": 8}}},
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
     "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "additionalProperties": False},
    {"type": "array", "items": {"type": "object"}, "maxItems": 2},
    {"type": "object", "properties": {"inner": {"type": "object"}}, "required": ["inner"]},
    {"anyOf": [{"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
               {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]},
]


def constraint_of(schema) -> Constraint:
    return Constraint("json_object") if schema is None else Constraint("json_schema", schema)


def no_repeats(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {pairs}"
    return dict(pairs)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request, tmp_path_factory):
    tokenizer, vocab_size = _load(request.param, tmp_path_factory)
    compiler = GrammarCompiler(tokenizer, vocab_size)
    raw = tokenizer.tokenizer
    real = raw.get_vocab_size()
    token_text = {}
    for t in range(real):
        try:
            token_text[t] = compiler.ll_tokenizer.decode_bytes([t]).decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a character: never a whole quote or escape
    return request.param, raw, compiler, token_text


def encode(raw, text: str) -> list[int]:
    return raw.encode(text, add_special_tokens=False).ids


def feed(state, raw, text: str) -> None:
    for t in encode(raw, text):
        assert state.accept(t), f"{text!r}: token {t} refused"


def allowed(compiler, state) -> list[int]:
    row = fill_bitmasks([state])[0]
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


_OPEN_KEY = re.compile(r'.*[{,]"((?:[^"\\]|\\.)*\\?(?:u[0-9a-fA-F]{0,3})?)$', re.DOTALL)


def closes_as(open_raw: str, token: str) -> str | None:
    """The key a token would close the open key as (decoded by Python's json, not ours), or None."""
    match = re.match(r'((?:[^"\\]|\\.)*)"', open_raw + token, re.DOTALL)
    if match is None or len(match.group(1)) < len(open_raw):
        return None
    try:
        return json.loads('"' + match.group(1) + '"')
    except ValueError:
        return None


# (text written so far, ending inside a key; the keys its innermost open object already holds)
OPEN_KEYS = [
    ('{"a":1,"', {"a"}),
    ('{"a":1,"a', {"a"}),
    ('{"ab":1,"a":2,"a', {"ab", "a"}),
    ('{"\\n":1,"', {"\n"}),
    ('{"\\n":1,"\\', {"\n"}),  # an escape left open
    ('{"\\u000a":1,"\\u00', {"\n"}),
    ('{"é":1,"', {"é"}),
    ('{"x":{"k":1,"k', {"k"}),
    ('{"l":[{"k":1},{"k":1,"k', {"k"}),
    ('{"description":"a","', {"description"}),
]


@pytest.mark.parametrize(("text", "used"), OPEN_KEYS)
def test_no_allowed_token_closes_a_key_as_one_its_object_holds(model, text, used) -> None:
    _, raw, compiler, token_text = model
    state = compiler.new_state(Constraint("json_object"))
    feed(state, raw, text)
    open_raw = _OPEN_KEY.match(text).group(1)
    tokens = allowed(compiler, state)
    assert tokens, "the mask allows nothing"
    repeats = {t: token_text[t] for t in tokens if t in token_text and closes_as(open_raw, token_text[t]) in used}
    assert not repeats, f"{text!r}: these tokens would repeat a key: {repeats}"
    # ...and the matcher refuses them too, if handed one anyway.
    closers = [t for t, s in token_text.items() if closes_as(open_raw, s) in used]
    assert not any(state.accept(t) for t in closers[:20])


@pytest.mark.parametrize("text", ['{"a":1,"a":2}', '{"\\n":1,"\\u000a":2}', '{"é":1,"é":2}',
                                  '{"l":[{"k":1},{"k":1,"k":2}]}', '{"x":{"k":1,"k":2}}',
                                  '{"description":"a","description":"b"}'])
def test_a_repeated_key_is_refused_at_the_token_that_closes_it(model, text) -> None:
    _, raw, compiler, _ = model
    state = compiler.new_state(Constraint("json_object"))
    ids = encode(raw, text)
    taken = 0
    for t in ids:
        if not state.accept(t):
            break
        taken += 1
    assert taken < len(ids), f"{text!r} was accepted whole"
    # Refused where the second copy of the key closes, not before.
    assert len(raw.decode(ids[:taken])) >= text.rindex(',"') + 2


@pytest.mark.parametrize("text", ['{"a":{"a":1},"b":[{"a":1},{"a":2}]}', '{"a":"b","b":"a"}',
                                  '{"ab":1,"a":2,"abc":3}', '{"a":1,"A":2,"a ":3}', '{"l":[{"k":1},{"k":2}]}'])
def test_equal_keys_in_different_objects_and_keys_equal_to_values_are_fine(model, text) -> None:
    _, raw, compiler, _ = model
    state = compiler.new_state(Constraint("json_object"))
    feed(state, raw, text)
    assert state.is_terminated()


def stubborn_walk(compiler, raw, constraints, seed: int, steps: int = 400,
                  script: str = '{"a":1,"a":1,"a":1,"a":1,"a":1}'):
    """Samples like a model set on writing `script` (by default `{"a":1,"a":1,...`): a 3-gram table of
    its tokens gives the token that follows the last two (or, failing that, the last one) a large
    bonus over random logits; after a while the closing characters get a larger one, so every
    output ends."""
    script = encode(raw, script)
    follows: dict[tuple[int, ...], int] = {}
    for i in range(1, len(script)):
        follows.setdefault(tuple(script[max(0, i - 2):i]), script[i])
        follows.setdefault((script[i - 1],), script[i])
    follows.setdefault((), script[0])
    closers = torch.tensor([t for t in range(raw.get_vocab_size())
                            if (s := raw.decode([t])) and set(s) <= set('"}]')])
    states = [compiler.new_state(c) for c in constraints]
    outputs: list[list[int]] = [[] for _ in states]
    gen = torch.Generator().manual_seed(seed)
    live = list(range(len(states)))
    for step in range(steps):
        if not live:
            break
        logits = torch.rand(len(live), compiler.vocab_size, generator=gen)
        for row, i in enumerate(live):
            last = outputs[i][-2:]
            wanted = follows.get(tuple(last), follows.get(tuple(last[-1:]), None) if last else follows[()])
            if wanted is not None:
                logits[row, wanted] += 10.0
        if step >= 40:
            logits[:, closers] += 20.0
        apply_masks(logits, [states[i] for i in live])
        for i, t in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
            assert states[i].failure is None, states[i].failure
            assert states[i].accept(t), f"sampled token {t} refused"
            outputs[i].append(t)
        live = [i for i in live if not states[i].is_terminated()]
    assert not live, "a walk did not end"
    return outputs


def test_a_model_set_on_repeating_a_key_writes_distinct_keys(model) -> None:
    _, raw, compiler, _ = model
    constraints = [constraint_of(s) for s in OPEN_SCHEMAS for _ in range(2)]
    outputs = stubborn_walk(compiler, raw, constraints, seed=53)
    wrote_a = 0
    for constraint, out in zip(constraints, outputs, strict=True):
        text = raw.decode(out)
        value = json.loads(text, object_pairs_hook=no_repeats)
        if constraint.kind == "json_schema":
            jsonschema.validate(value, constraint.schema)
        wrote_a += '"a":' in text
    assert wrote_a >= len(constraints) // 2, "the walk did not try to repeat the key (the test proves nothing)"


NUMBERS = re.compile(r'(?<![\w".])-?\d[\d.eE+-]*')


@pytest.mark.parametrize(("schema", "head"), [
    (None, '{"a":'), ({"type": "number"}, ""), ({"type": "array", "items": {"type": "integer"}}, "[1,"),
    ({"type": "object", "properties": {"lat": {"type": "number"}}}, '{"lat":-12.'),
])
def test_a_number_stops_growing_at_its_bound(model, schema, head) -> None:
    _, raw, compiler, token_text = model
    state = compiler.new_state(constraint_of(schema))
    feed(state, raw, head)
    number = head[head.rfind(":") + 1:] if head.endswith(".") else ""
    digits = 0
    for t in encode(raw, "1" * 60):
        if not state.accept(t):
            break
        digits += len(raw.decode([t]))
    assert len(number) + digits >= MAX_NUMBER_CHARS  # it got there...
    assert len(number) + digits < MAX_NUMBER_CHARS + 8  # ...and no further (the last token may pass it)
    tokens = allowed(compiler, state)
    assert tokens and not any(token_text.get(t, "x")[:1] in "0123456789.eE+-" for t in tokens)
    if schema is None:
        feed(state, raw, "}")
        assert state.is_terminated()


def test_a_model_set_on_digits_writes_short_numbers(model) -> None:
    _, raw, compiler, _ = model
    schemas = [None, {"type": "object", "properties": {"lat": {"type": "number"}, "n": {"type": "integer"}},
                      "required": ["lat", "n"], "additionalProperties": False},
               {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}]
    constraints = [constraint_of(s) for s in schemas for _ in range(2)]
    outputs = stubborn_walk(compiler, raw, constraints, seed=7, script='{"a":1.23456789123456789123456789123456789'
                            '1234567891234567891234567891234567891234567891234567891234567890}')
    long_ones = 0
    for constraint, out in zip(constraints, outputs, strict=True):
        text = raw.decode(out)
        value = json.loads(text, object_pairs_hook=no_repeats)
        if constraint.kind == "json_schema":
            jsonschema.validate(value, constraint.schema)
        lengths = [len(m) for m in NUMBERS.findall(text)]
        assert all(n < MAX_NUMBER_CHARS + 8 for n in lengths), text
        long_ones += any(n >= MAX_NUMBER_CHARS for n in lengths)
    assert long_ones >= 2, "no walk got to the bound (the test proves nothing)"


def test_rollback_and_replay_keep_the_keys_in_step(model) -> None:
    _, raw, compiler, _ = model
    first, second = encode(raw, '{"a":1'), encode(raw, ',"b":2')
    again = encode(raw, ',"b":3}')
    state = compiler.new_state(Constraint("json_object"))
    assert all(state.accept(t) for t in first + second)
    assert not all(state.accept(t) for t in again)  # "b" is taken
    state.replay(first + second)
    state.rollback(len(second))  # "b" is gone again
    assert all(state.accept(t) for t in again) and state.is_terminated()
    replayed = compiler.new_state(Constraint("json_object"))
    assert not replayed.replay(first + second + again)


def test_a_schema_whose_every_key_is_used_ends_as_an_error(model) -> None:
    _, raw, compiler, _ = model
    schema = {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}},
              "additionalProperties": False, "minProperties": 0}
    state = compiler.new_state(Constraint("json_schema", schema))
    feed(state, raw, '{"a":1,"b":2,"a')
    row = fill_bitmasks([state])[0]
    assert torch.equal(row, compiler.eos_mask)
    assert "repeats one already in its object" in state.failure


# --- forced tool calls: the envelope call_schema builds ---------------------------------------------------

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}}}}})


@pytest.mark.parametrize("text", [
    '{"name":"get_weather","arguments":{"city":"Oslo","description":"x"}}',
    '{"name":"get_weather","arguments":{"description":"x"}}',
    '{"name":"get_weather","arguments":{"where":{"lat":1,"lon":2}}}',
])
def test_a_forced_call_takes_only_the_declared_keys(model, text) -> None:
    _, raw, compiler, _ = model
    state = compiler.new_state(Constraint("json_schema", call_schema([WEATHER])))
    assert not all(state.accept(t) for t in encode(raw, text))
    ok = compiler.new_state(Constraint("json_schema", call_schema([WEATHER])))
    feed(ok, raw, '{"name":"get_weather","arguments":{"city":"Oslo","where":{"lat":1}}}')
    assert ok.is_terminated()


# --- the real model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.worker.llm import LLM

    try:
        builtin_model_path("smollm2-135m")
    except Exception as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    return LLM("smollm2-135m", runtime="cpu-int8", device="cpu", num_kv_blocks=128)


@pytest.mark.slow
def test_smollm2_forced_calls_and_open_objects_never_repeat_a_key(smollm2) -> None:
    """The issue's case: SmolLM2 forced to call get_weather wrote `"description": ...` 25 times until
    max_tokens (greedy). Now the arguments hold declared keys only, and in an open object (json_object,
    where any key may come) no key twice; every output ends within max_tokens."""
    from inferplane.worker.engine.sampling import SamplingParams

    call = Constraint("json_schema", call_schema([WEATHER]))
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    describe = [{"role": "user", "content": "Describe Oslo in JSON with many description fields."}]
    params = [SamplingParams(max_tokens=120, temperature=t, seed=s, constraint=c)
              for c in (call, Constraint("json_object")) for t, s in ((0, 0), (0.7, 1), (0.7, 2), (1.0, 3))]
    prompts = [ask] * 4 + [describe] * 4
    outs = smollm2.chat(prompts, params)
    declared = set(WEATHER.function.parameters["properties"])
    for p, out in zip(params, outs, strict=True):
        print(p.constraint.kind, p.temperature, out.finish_reason, repr(out.text))
    for p, out in zip(params, outs, strict=True):
        if p.constraint is call:  # the arguments are closed: every call ends
            assert out.finish_reason == "stop", (out.finish_reason, out.text)
            value = json.loads(out.text, object_pairs_hook=no_repeats)
            assert value["name"] == "get_weather" and set(value["arguments"]) <= declared, out.text
        else:  # made-up keys may go on to max_tokens, but none twice in one object
            assert out.finish_reason in ("stop", "length")
            assert json_prefix(out.text), out.text


def json_prefix(text: str):
    """The longest prefix of a cut-off JSON text that closing its open strings and brackets makes
    whole, parsed with `no_repeats` (which raises on a repeated key); None if none parses."""
    for cut in range(len(text), 0, -1):
        head = text[:cut].rstrip(",:")
        closers, in_string, escaped = [], False, False
        for c in head:
            if in_string:
                in_string = escaped or c != '"'
                escaped = not escaped and c == "\\"
            elif c == '"':
                in_string = True
            elif c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                closers.pop()
        if escaped:
            continue
        try:
            return json.loads(head + ('"' if in_string else "") + "".join(reversed(closers)),
                              object_pairs_hook=no_repeats)
        except ValueError:
            continue
    return None


def test_a_token_holding_a_whole_key_is_blocked_where_the_key_is_used() -> None:
    """A token such as `""` or `,"id"` opens and closes a key in one piece: where its object already
    holds that key, it is blocked as a closing quote would be (SmolLM2 at temperature 1 wrote
    `{"":1,"":1,...}` through such tokens)."""
    from inferplane.worker.structured.json_guard import JsonTracker, TokenIndex

    tokens = [b'""', b',"id"', b'"', b'id', b'1', b'{', b':', b',', b'"a"']
    index = TokenIndex(tokens)
    tracker = JsonTracker()
    tracker.feed(b'{"":1,"id":2')
    blocked = set(tracker.blocked(index))
    assert 1 in blocked and 8 not in blocked  # `,"id"` repeats a key (after a value: `""` is no JSON here)
    tracker.feed(b',')
    assert 0 in set(tracker.blocked(index)) and 8 not in set(tracker.blocked(index))
    nested = JsonTracker()
    nested.feed(b'{"":{')  # a new object: its keys are its own
    assert 0 not in set(nested.blocked(index))
