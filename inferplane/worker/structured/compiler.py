"""Compiling a constraint into an llguidance grammar, once per distinct constraint and model.

`GrammarCompiler` holds one model's tokenizer as llguidance reads it and an LRU cache of compiled
grammars (and of refusals). Compiling happens off the engine's thread (async_engine.py hands a
constrained request to the engine only once `GrammarCompiler.prepare` has compiled it); each
sequence then gets its own copy of the compiled matcher, a `GrammarState` (state.py).

The engine is llguidance, chosen by measurement (`python -m inferplane.bench.grammar`: SmolLM2's
49,152-token vocabulary, a 10-property schema with a nested object, arrays, an enum, numbers and
strings, 64 sequences stepping token by token through valid documents; a busy 2-core machine,
fastest of 3 interleaved rounds; µs per step per sequence, "engine" = fill the bitmask + accept):

    threads  engine      batch  fill  accept  engine | compile ms  import ms  tokenizer ms
       2     llguidance     64  47.2     6.6    53.8 |       1.6          6           366
       2     xgrammar       64  36.8     4.6    41.4 |      36.3        750           156
       1     llguidance     64  39.3     4.9    44.3 |
       1     xgrammar       64  30.2     4.9    35.1 |
       2     llguidance      1  53.4     8.6    61.9 |
       2     xgrammar        1 271.2    16.8   288.0 |

xgrammar 0.2.9 is ~20% cheaper per step at batch 64 (~5x with its default unbounded whitespace,
which precomputes better), but fails correctness: in a string with maxLength/minLength it admits
raw control characters (U+0000, U+0010, a raw tab), i.e. invalid JSON that `json.loads` rejects;
it also allows no escape sequence at all in such strings, `import xgrammar` pulls in transformers
(750 ms), and given special tokens' text it lets "<|im_start|>" appear inside a JSON string. So
the rule "lowest mask cost at batch 64 unless it fails correctness" picks llguidance, which passed
every check, needs no transformers (it reads our `tokenizers` JSON) and compiles ~20x faster. Its
one narrowing: no \\uXXXX escape of a printable character (the model writes the character itself).

JSON semantics are llguidance's, i.e. JSON Schema's: undeclared properties are allowed unless the
schema says additionalProperties: false (OpenAI's strict schemas always do). Unsupported keywords
are rejected (GrammarError), not ignored. What a grammar cannot say (no repeated key, no endless
number) the JSON tracker adds per sequence (json_guard.py); the compiler builds the token index it
reads. Whatever llguidance refuses, or gives up on at the first step (probed here, under the fuel
limits of `GrammarLimits`), is a plain GrammarError naming the request field.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from inferplane.worker.structured.constraints import (
    JSON_KINDS,
    KIND_NAMES,
    LIMITS,
    Constraint,
    GrammarError,
    GrammarLimits,
    one_line,
    param_for,
)
from inferplane.worker.structured.json_guard import TokenIndex
from inferplane.worker.structured.masks import bitmask_of, new_bitmask
from inferplane.worker.structured.state import GrammarState

log = logging.getLogger(__name__)


@functools.cache
def _ll():
    """llguidance, imported on first use so that a worker serving no structured output never loads it.
    (Not `llguidance.torch`: it wraps a function in torch.compile at import, seconds of start-up.)"""
    import llguidance

    return llguidance


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; keeps the last `cache_size` compiled grammars
    (and refusals, so a repeated bad constraint costs nothing). Thread-safe: the worker compiles on
    a small pool (async_engine.py) while the engine thread builds states from what it compiled, and
    concurrent compiles of one constraint wait for the first instead of repeating it.

    `tokenizer`: a `TextTokenizer` (its EOS is the default) or a `tokenizers.Tokenizer`; llguidance
    reads the tokenizer's own JSON (no transformers needed), special tokens included, which it never
    lets a grammar's text use. `vocab_size`: the model's (the logits' width), which may exceed the
    tokenizer's; ids past the tokenizer's are never allowed. `eos_token_ids`: the tokens that may
    (and, once the grammar is complete, must) end the output. `threads`: for filling a batch's masks
    (None: llguidance's default, 80% of the CPUs up to 32). `limits`: llguidance's fuel bounds.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None, *,
                 cache_size: int = 64, threads: int | None = None, limits: GrammarLimits | None = None) -> None:
        ll = _ll()
        self.vocab_size = vocab_size
        self.eos_token_ids = _eos_ids(tokenizer, eos_token_ids, vocab_size)
        tok = getattr(tokenizer, "tokenizer", tokenizer)  # TextTokenizer → tokenizers.Tokenizer
        self.ll_tokenizer = ll.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self.executor = ll.LLExecutor(num_threads=threads)
        self.eos_mask = bitmask_of(self.eos_token_ids, vocab_size)
        self.limits = limits or LIMITS
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> matcher or GrammarError
        self._cache_size = cache_size
        self._pending: dict[str, threading.Event] = {}  # keys being compiled now
        self._lock = threading.Lock()
        self._token_index: TokenIndex | None = None
        self._index_lock = threading.Lock()

    def token_index(self) -> TokenIndex:
        """Each token's bytes, indexed for the JSON tracker (json_guard.py), built on first use:
        ~0.1 s for a 49k vocabulary, on the compile pool when a JSON constraint is compiled there."""
        index = self._token_index
        if index is not None:
            return index
        with self._index_lock:  # not the cache's lock: lookups go on while it is built
            if self._token_index is None:
                decode = self.ll_tokenizer.decode_bytes
                self._token_index = TokenIndex([decode([t]) for t in range(self.vocab_size)])
            return self._token_index

    def parser_limits(self):
        limits = self.limits
        return _ll().LLParserLimits(
            initial_lexer_fuel=limits.initial_lexer_fuel, step_lexer_fuel=limits.step_lexer_fuel,
            step_max_items=limits.step_max_items, max_lexer_states=limits.max_lexer_states,
            max_grammar_size=limits.max_grammar_size, verbose_errors=False)

    def compile(self, constraint: Constraint):
        """The compiled grammar: an llguidance matcher at the start state, never advanced itself
        (states are its copies), from the cache when there. GrammarError if it is refused."""
        key = constraint.key
        while True:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return _unwrap(self._cache[key])
                pending = self._pending.get(key)
                if pending is None:
                    self._pending[key] = threading.Event()
                    break
            pending.wait()  # another thread compiles it; then it is cached (or failed unexpectedly: retry)
        compiled: Any = None
        try:
            compiled = self._compile(constraint)
        except GrammarError as exc:
            compiled = exc
        finally:
            with self._lock:
                if compiled is not None:
                    self._cache[key] = compiled
                    self._cache.move_to_end(key)
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
                self._pending.pop(key).set()
        return _unwrap(compiled)

    def prepare(self, constraint: Constraint) -> None:
        """Compiles `constraint` (GrammarError if refused) and attaches the result to it, so that
        `new_state` needs no cache (which may have evicted it by then) and never compiles."""
        object.__setattr__(constraint, "_compiled", (self, self.compile(constraint)))

    def prepare_cached(self, constraint: Constraint) -> bool:
        """`prepare` if the cache already holds the constraint's grammar (GrammarError if it holds its
        refusal); False, without compiling, if not."""
        with self._lock:
            entry = self._cache.get(constraint.key)
        if entry is None:
            return False
        object.__setattr__(constraint, "_compiled", (self, _unwrap(entry)))
        return True

    def new_state(self, constraint: Constraint) -> GrammarState:
        """A sequence's state at the start of its output."""
        attached = constraint._compiled
        compiled = attached[1] if attached is not None and attached[0] is self else self.compile(constraint)
        return GrammarState(self, compiled, constraint)

    def _compile(self, constraint: Constraint):
        ll = _ll()
        if constraint.kind in JSON_KINDS:
            self.token_index()
        try:
            grammar = _grammar(constraint)
        except ValueError as exc:
            raise GrammarError(_refusal(constraint, str(exc))) from None
        matcher = ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.parser_limits())
        if matcher.is_error():
            raise GrammarError(_refusal(constraint, matcher.get_error()))
        self._probe(constraint, matcher)
        return matcher

    def _probe(self, constraint: Constraint, matcher) -> None:
        """Computes the first mask now (off the engine thread when compiling there; states copy the
        lexer it built) and takes one allowed token on a copy: a grammar llguidance gives up on at
        its first step is refused here, as a 400, rather than failing the request mid-output."""
        if matcher.is_stopped():
            return
        mask = new_bitmask(1, self.vocab_size)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if matcher.is_error():
            raise GrammarError(_refusal(constraint, matcher.get_error()))
        allowed = _first_allowed(mask[0], self.vocab_size, exclude=self.eos_token_ids)
        if allowed is None:
            if not bool(mask.any()):
                raise GrammarError(_refusal(constraint, "no token can start the output"))
            return  # only EOS: an empty output is the only one
        probe = matcher.deep_copy()
        if probe.try_consume_tokens([allowed]) == 1 and not probe.is_stopped():
            probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        # Copies share the template's lexer: if the probe ran it out of fuel, every copy fails.
        check = matcher.deep_copy()
        check.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        for m in (probe, check):
            if m.is_error():
                raise GrammarError(_refusal(constraint, m.get_error()))

    def forget(self, constraint: Constraint, compiled) -> None:
        """Drops `compiled` from the cache: llguidance's copies share their template's lexer, and
        once one copy runs it out of fuel the lexer stays in error, so every later copy would fail.
        The next request with this constraint compiles afresh."""
        with self._lock:
            if self._cache.get(constraint.key) is compiled:
                del self._cache[constraint.key]


def _unwrap(entry):
    if isinstance(entry, GrammarError):
        raise GrammarError(str(entry))
    return entry


def _first_allowed(row: torch.Tensor, vocab_size: int, exclude: Sequence[int]) -> int | None:
    """The lowest token id a bitmask row allows, other than `exclude`."""
    row = row.clone()
    for t in exclude:
        row[t >> 5] &= ~(1 << (t & 31))
    words = row.nonzero().flatten()
    if words.numel() == 0:
        return None
    word = int(words[0])
    bits = int(row[word]) & 0xFFFFFFFF
    token = word * 32 + (bits & -bits).bit_length() - 1
    return token if token < vocab_size else None


# What llguidance says when one of its bounds is hit, and what marks text a client must not see.
_TOO_COMPLEX = ("too many", "too big", "too large", "fuel", "limits.", "(limit")
_INTERNAL = ("panic", "assertion failed", "backtrace", "unwrap()", "internal error", "<state>")


def _refusal(constraint: Constraint, raw: str) -> str:
    """A compile-time refusal as the client sees it: llguidance's message when it describes the
    request's own mistake (a regex that does not parse, an unsupported schema keyword), a plain
    "too complex" when one of its bounds was hit, never an internal panic or parser dump."""
    lowered = raw.lower()
    where = f"{param_for(constraint.kind)}: {KIND_NAMES[constraint.kind]}"
    too_complex = f"{where}: too large or complex for the grammar engine"
    if any(word in lowered for word in _INTERNAL):
        log.warning("grammar engine failed on %s: %s", constraint.key, one_line(raw))
        return too_complex
    if any(word in lowered for word in _TOO_COMPLEX):
        log.info("grammar engine refused %s: %s", constraint.key, one_line(raw))
        return f"{too_complex} (over its limits)"
    return f"{param_for(constraint.kind)}: {_what(constraint)}: {one_line(raw)}"


# JSON between tokens: OpenAI's separators (", " and ": ") and nothing else. A flexible pattern lets
# a small model spend its whole budget on whitespace (seen: hundreds of "\r\t" with a random model),
# leaving the document unfinished at max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint (checked when a matcher is built from it)."""
    ll = _ll()
    options = JSON_OPTIONS
    if constraint.kind == "json_schema":
        return ll.LLMatcher.grammar_from_json_schema(constraint.spec, defaults=options)
    if constraint.kind == "json_object":
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if constraint.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(constraint.spec)
    # Lark string literals take JSON's escapes, so no choice needs regex escaping.
    return ll.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.spec))


def _what(constraint: Constraint) -> str:
    return {"json_schema": "invalid JSON schema", "json_object": "invalid JSON schema",
            "regex": "invalid regex"}.get(constraint.kind, "invalid choice")


def _eos_ids(tokenizer, eos_token_ids: Sequence[int] | None, vocab_size: int) -> list[int]:
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = [] if eos is None else [eos]
    ids = sorted({int(t) for t in eos_token_ids})
    if not ids:
        raise ValueError("structured outputs need at least one EOS token id to end the output with")
    if not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"EOS token ids {ids} must be below the vocab size {vocab_size}")
    return ids

