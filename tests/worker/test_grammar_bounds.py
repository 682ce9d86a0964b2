"""Structured outputs under attack (issue 29, items 1 and 2): bounded constraints, compiling off the
engine thread, and a grammar the engine gives up on ending its request as an error.

A tiny model with a real (byte-level) tokenizer. Nothing here measures time: "does not stall" is
asserted as an ordering (another request finished while a compile was held open by an event), and
a timeout only keeps a broken build from hanging the run.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

pytest.importorskip("llguidance")

from inferplane.worker import structured  # noqa: E402
from inferplane.worker.engine.engine import Engine  # noqa: E402
from inferplane.worker.engine.options import EngineOptions  # noqa: E402
from inferplane.worker.engine.sampling import SamplingParams  # noqa: E402
from inferplane.worker.serve.async_engine import AsyncEngine  # noqa: E402
from inferplane.worker.structured import Constraint, GrammarCompiler, GrammarError, constraints, fill_bitmasks  # noqa: E402
from inferplane.worker.structured.compiler import _refusal  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 7]
INTERNAL = ("assert", "panic", "u16", "backtrace", "unwrap", "<state>", "rust", "too many expressions")
HOLD = 60  # seconds a held compile waits at most (only a broken build ever waits that long)


def _plain(message: str) -> bool:
    return not any(word in message.lower() for word in INTERNAL)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    from inferplane.bench.tiny_model import make_tiny_model
    from inferplane.worker.model.loader import load_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-grammar-bounds"))
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    options = EngineOptions(device="cpu", num_kv_blocks=64, block_size=8, max_num_seqs=4)
    return Engine(loaded, options, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def compiler(engine) -> GrammarCompiler:
    return engine.intake.grammar_compiler()


def _run(engine: Engine, request_id: str) -> list:
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


# --- item 1: sizes are refused at once, as a plain 400 naming the field ------------------------------------


def test_a_100k_choice_constraint_is_refused_naming_the_field():
    choices = [f"choice{i}" for i in range(100_000)]
    with pytest.raises(GrammarError) as refused:
        Constraint("choice", choices)
    message = str(refused.value)
    assert message.startswith("structured_outputs: choice: too many choices")
    assert _plain(message)
    # The worker's own parsing of the wire format refuses it the same way (its INVALID_ARGUMENT).
    from inferplane.v1 import worker_pb2
    from inferplane.worker.serve.server import params_from_proto

    proto = worker_pb2.SamplingParams(constraint_kind="choice", constraint_spec=json.dumps(choices))
    with pytest.raises(GrammarError, match=r"^structured_outputs: choice: too many choices"):
        params_from_proto(proto)


@pytest.mark.parametrize("kind, spec, field", [
    ("choice", ["x" * 4000] * 9, "structured_outputs: choice: the choices are too long together"),
    ("regex", "a" * 10_000, "structured_outputs: regex: the pattern is too long"),
    ("regex", "(a{1000}){1000}", "structured_outputs: regex: counted repetitions multiply to 1000000"),
    ("regex", "x(y|(ab{100}){101})", "structured_outputs: regex: counted repetitions multiply to 10100"),
    ("json_schema", {"type": "object", "description": "x" * (200 << 10)},
     "response_format: the JSON schema is too large"),
    ("json_schema", json.dumps({"type": "object", "description": "x" * (200 << 10)}),
     "response_format: the JSON schema is too large"),
    ("json_schema", json.loads("{" + '"a":{' * 80 + "}" * 80 + "}"),
     "response_format: the JSON schema is nested too deeply"),
    ("json_schema", "[" * 30_000 + "]" * 30_000, "response_format: the JSON schema is nested too deeply"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}}},
     "response_format: JSON schema pattern: counted repetitions multiply to 1000000"),
    ("json_schema", {"type": "object", "patternProperties": {"(x{500}){500}": {"type": "string"}}},
     "response_format: JSON schema patternProperties: counted repetitions"),
])
def test_size_bounds_are_plain_errors_naming_the_field(kind, spec, field):
    with pytest.raises(GrammarError) as refused:
        Constraint(kind, spec)
    assert str(refused.value).startswith(field)
    assert _plain(str(refused.value))


def test_constraints_within_the_bounds_still_compile(compiler):
    for constraint in (Constraint("regex", r"[a-z]{2,5}-(\d{1,3}\.){3}\d{1,3}"), Constraint("regex", "(a{100}){100}"),
                       Constraint("choice", [f"option number {i}" for i in range(structured.LIMITS.max_choices)])):
        assert compiler.new_state(constraint).failure is None


def test_a_limit_llguidance_hits_is_a_plain_refusal(engine):
    # Past llguidance's own grammar-size bound (here made small): its message is not the client's.
    small = GrammarCompiler(engine.tokenizer, engine.loaded.config.vocab_size, sorted(engine.eos_ids),
                            limits=structured.GrammarLimits(max_grammar_size=200))
    with pytest.raises(GrammarError) as refused:
        small.compile(Constraint("choice", [f"word{i}" for i in range(300)]))
    assert str(refused.value).startswith("structured_outputs: choice: too large or complex for the grammar engine")
    assert _plain(str(refused.value))
    # A repeat of a refused constraint is answered from the cache, the same way.
    with pytest.raises(GrammarError, match="too large or complex"):
        small.compile(Constraint("choice", [f"word{i}" for i in range(300)]))


def test_an_internal_panic_never_reaches_the_client():
    raw = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n  0: <unknown>")
    message = _refusal(Constraint("choice", ["a", "b"]), raw)
    assert message == "structured_outputs: choice: too large or complex for the grammar engine"


# --- item 2: a grammar the matcher gives up on is an error, never a "stop" -------------------------------


@pytest.fixture
def unchecked_repeats(monkeypatch):
    """Lets nested counted repetitions past the static check, to reach llguidance's fuel bounds."""
    monkeypatch.setattr(constraints, "LIMITS", structured.GrammarLimits(max_regex_repeat=10**12), raising=False)


def test_a_pattern_llguidance_gives_up_on_at_once_is_refused_when_compiling(engine, unchecked_repeats):
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.config.vocab_size, sorted(engine.eos_ids))
    with pytest.raises(GrammarError) as refused:
        compiler.compile(Constraint("regex", "(a{1000}){1000}"))
    assert str(refused.value).startswith("structured_outputs: regex: too large or complex")
    assert _plain(str(refused.value))


# "bx", or "d" then a million forced "a"s. Compiling probes the first path (fine); the model is made
# to take the second (logit_bias), where the matcher runs out of fuel after its first token.
GIVES_UP_LATER = "(bx|d(a{1000}){1000})"


def _gives_up_later(engine: Engine, **kwargs) -> SamplingParams:
    d = engine.tokenizer.encode("d")[-1]
    return SamplingParams(temperature=0, logit_bias={d: 100.0}, constraint=Constraint("regex", GIVES_UP_LATER),
                          **kwargs)


def test_a_matcher_that_gives_up_mid_output_ends_the_request_as_an_error(engine, unchecked_repeats):
    # The request must not come back as a "stop" with text that does not match the regex.
    engine.add_request(PROMPT, _gives_up_later(engine, max_tokens=20), "gives-up")
    outs = _run(engine, "gives-up")
    final = outs[-1]
    assert final.finished and final.finish_reason == "error"
    assert all(o.finish_reason != "stop" for o in outs)
    assert final.error.startswith("structured_outputs: regex: the grammar engine gave up") and _plain(final.error)
    assert [t for o in outs for t in o.new_token_ids] == engine.tokenizer.encode("d")[-1:]
    assert final.num_output_tokens == 1  # "d"; the token sampled after the matcher gave up is not output
    # Its cached grammar (whose shared lexer is now in error) is dropped: the next request starts afresh.
    engine.add_request(PROMPT, _gives_up_later(engine, max_tokens=20), "gives-up-again")
    assert _run(engine, "gives-up-again")[-1].error.startswith("structured_outputs: regex: the grammar engine gave up")


def test_a_failed_mask_marks_the_state_and_allows_only_eos(compiler):
    state = compiler.new_state(Constraint("regex", "[a-z]{3}"))
    state.matcher.consume_token(compiler.vocab_size - 1)  # a padding id: llguidance's error state
    bitmask = fill_bitmasks([state])
    assert state.failure is not None and state.failure.startswith("structured_outputs: regex: the grammar engine")
    assert torch.equal(bitmask[0], compiler.eos_mask)
    assert not state.accept(compiler.eos_token_ids[0])


# --- compiling off the engine thread -----------------------------------------------------------------------


class HeldCompiles:
    """Holds every grammar compile open until `release` is set, and records the order of events."""

    def __init__(self, monkeypatch):
        self.started = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()
        self.order: list[str] = []
        self.threads: list[str] = []
        original = GrammarCompiler._compile

        def held(compiler, constraint):
            self.threads.append(threading.current_thread().name)
            self.started.set()
            self.release.wait(HOLD)
            try:
                return original(compiler, constraint)
            finally:
                self.order.append("compiled")
                self.done.set()

        monkeypatch.setattr(GrammarCompiler, "_compile", held)


@pytest.fixture
def held(monkeypatch) -> HeldCompiles:
    return HeldCompiles(monkeypatch)


@pytest.fixture
async def async_engine(engine):
    finished = []
    added: list[str] = []
    add_request = engine.add_request

    def recording_add(*args, **kwargs):
        added.append(args[2] if len(args) > 2 else kwargs.get("request_id"))
        return add_request(*args, **kwargs)

    engine.add_request = recording_add
    ae = AsyncEngine(engine, on_finished=finished.append)
    ae.finished, ae.added = finished, added
    yield ae
    ae.stop()
    del engine.add_request


def _scheduled_ids(engine: Engine) -> set[str]:
    return {seq.group_id for seq in [*engine.scheduler.running, *engine.scheduler.waiting]}


async def _drain(stream) -> list:
    return [out async for out in stream]


async def _wait(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, HOLD)


async def test_other_requests_progress_while_a_grammar_compiles(async_engine, held):
    constrained = SamplingParams(max_tokens=4, temperature=0, constraint=Constraint("regex", "[a-z]{3,8}"))
    heavy = async_engine.submit("heavy", PROMPT, constrained, tenant="a")
    await _wait(held.started)
    # Compiling: in flight (the drain and the autoscaler see it), yet no scheduler slot nor queue place.
    assert async_engine.num_in_flight == 1
    assert "heavy" not in _scheduled_ids(async_engine.engine) and "heavy" not in async_engine.added
    assert not held.threads[0].startswith("engine-loop")

    other = await asyncio.wait_for(_drain(async_engine.submit("other", PROMPT, SamplingParams(max_tokens=4),
                                                              tenant="b")), HOLD)
    held.order.append("other finished")
    assert other[-1].finished and other[-1].finish_reason in ("length", "stop")
    held.release.set()
    outs = await asyncio.wait_for(_drain(heavy), HOLD)
    assert held.order == ["other finished", "compiled"]
    assert outs[-1].finished and async_engine.added == ["other", "heavy"]
    assert async_engine.num_in_flight == 0


async def test_a_request_aborted_while_compiling_never_reaches_the_engine(async_engine, held):
    constraint = Constraint("regex", "[0-9]{2,6}")
    stream = async_engine.submit("dropped", PROMPT, SamplingParams(max_tokens=4, constraint=constraint))
    await _wait(held.started)
    assert async_engine.num_in_flight == 1
    stream.abort()
    # Finished at once (counted as aborted), before its compile ends, and no longer in flight.
    assert [(o.request_id, o.finish_reason) for o in async_engine.finished] == [("dropped", "abort")]
    assert async_engine.num_in_flight == 0
    held.release.set()
    await _wait(held.done)
    await asyncio.sleep(0.05)  # give a wrongly queued request the chance to reach the engine
    assert "dropped" not in async_engine.added and "dropped" not in _scheduled_ids(async_engine.engine)
    # The compiled grammar was kept: the same constraint now starts without compiling again.
    again = await asyncio.wait_for(_drain(async_engine.submit("again", PROMPT, SamplingParams(
        max_tokens=4, constraint=Constraint("regex", "[0-9]{2,6}")))), HOLD)
    assert again[-1].finished and held.order == ["compiled"]


async def test_a_refused_grammar_fails_its_stream_with_the_plain_message(async_engine, unchecked_repeats):
    params = SamplingParams(max_tokens=4, constraint=Constraint("regex", "x(a{1000}){1000}"))
    with pytest.raises(GrammarError, match=r"^structured_outputs: regex: too large or complex"):
        await asyncio.wait_for(_drain(async_engine.submit("refused", PROMPT, params)), HOLD)
    assert "refused" not in async_engine.added and async_engine.num_in_flight == 0


async def test_a_grammar_giving_up_mid_output_fails_the_stream(async_engine, unchecked_repeats):
    stream = async_engine.submit("mid", PROMPT, _gives_up_later(async_engine.engine, max_tokens=20, n=2))
    seen = []
    with pytest.raises(GrammarError, match=r"^structured_outputs: regex: the grammar engine gave up"):
        async for out in stream:
            seen.append(out)
    assert all(o.finish_reason != "stop" for o in seen)
    assert async_engine.num_in_flight == 0 and not async_engine.engine.has_unfinished()
