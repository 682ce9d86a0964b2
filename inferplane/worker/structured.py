"""Structured outputs: constraining sampling to a JSON schema, any JSON object, a regex or a choice.

A request's `Constraint` compiles once per model (`GrammarCompiler`, an LRU cache) into a grammar;
each sequence then owns a `GrammarState` that says which tokens may come next. `apply_masks` sets
the logits of every other token to -inf for a whole batch at once, before the sampler runs, so the
sampler (inferplane/worker/engine/sampling.py) needs no change and its seeded draws stay batch-independent.

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
Applying the mask (the same torch code for both engines: the bitmask format is identical) adds
~75-140 µs per sequence on that CPU; on a GPU it is a few kernels over [B, V].

JSON semantics are llguidance's, i.e. JSON Schema's: undeclared properties are allowed unless the
schema says additionalProperties: false (OpenAI's strict schemas always do). Unsupported keywords
are rejected (GrammarError), not ignored. llguidance writes a declared property at most once, but
undeclared keys could repeat, and a number has no length bound; a `JsonTracker` per JSON sequence
(json_guard.py) masks the tokens that would close a key its object already holds or make a number
longer than MAX_NUMBER_CHARS, so no JSON output repeats a key or runs on in one number.

Bounds (`LIMITS`, one place): a constraint's size is checked when the request is parsed (choices,
their bytes, a regex's length and how far its counted repetitions multiply, a schema's bytes and
depth, its patterns like regexes), and llguidance runs under fuel limits (`LLParserLimits`) so that
neither compiling nor one mask can run for seconds; whatever llguidance itself refuses or gives up
on becomes a plain GrammarError naming the request field, never its internal text (a Rust panic,
parser state). Compiling happens off the engine's thread (async_engine.py hands a constrained
request to the engine only once `GrammarCompiler.prepare` has compiled it). A matcher that gives up
mid-output (`GrammarState.failure`) ends the request as an error, not as a `stop`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inferplane.api.grammar_limits import MAX_CONSTRAINT_CHOICES, MAX_REGEX_CHARS
from inferplane.worker.json_guard import MAX_NUMBER_CHARS, JsonTracker, TokenIndex

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "choice")
JSON_KINDS = ("json_object", "json_schema")
PARAM = "response_format"
EXTENSION_PARAM = "structured_outputs"  # regex and choice come from vLLM's extension, not response_format


def param_for(kind: str) -> str:
    """The request field an error about a `kind` constraint names."""
    return EXTENSION_PARAM if kind in ("regex", "choice") else PARAM

_BITS = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32), torch.arange(32, dtype=torch.int32))


class GrammarError(ValueError):
    """A constraint the request got wrong; the message is one line naming the request parameter."""


# --- limits ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrammarLimits:
    """How large a constraint may be and how much work llguidance may do for one; every bound on
    structured outputs lives here. A constraint over a size bound is a 400 naming its field; one
    llguidance gives up on is refused when compiling, or ends its request as an error mid-output.

    The fuel figures are llguidance's units (its docs: ~50k/ms initial, ~14k/ms per step; measured
    10-100x slower on a busy 2-core CPU). With llguidance's defaults, (a{1000}){1000} took 1.8-2.7 s
    for one mask there; with these, 40-240 ms for the first mask (computed when compiling, off the
    engine thread) and 10-50 ms for a later one, after which the matcher gives up (an error). Every
    schema, regex and choice list of tests/worker/test_structured.py still works on SmolLM2's
    49k-token vocabulary, as do 300-step walks through a 300-property schema, ten string formats,
    30 patterns, a 50-way anyOf and 1,024 choices. A 116 KB, 2,500-property schema compiles in
    1-2 s there: on the compile pool, which llguidance leaves the GIL to while it builds a matcher.
    The lexer is shared by a compiled grammar's copies: at ~1-2 kB a state, `max_lexer_states`
    bounds its memory (the cache holds up to 64 grammars).
    """

    max_choices: int = MAX_CONSTRAINT_CHOICES  # entries of a choice constraint (the gateway checks it too)
    max_choice_bytes: int = 32 << 10  # their UTF-8 bytes together
    max_regex_chars: int = MAX_REGEX_CHARS
    # The product of nested counted repetitions' bounds along any path: (a{1000}){1000} is 10^6.
    # Derivative-based lexing builds states per repeat, so the product is what costs; * + ? cost 1.
    max_regex_repeat: int = 10_000
    max_schema_bytes: int = 128 << 10  # the schema's compact JSON
    max_schema_depth: int = 64  # nesting of its JSON objects and arrays (OpenAI: 10 levels of objects)
    # llguidance's own (LLParserLimits); its defaults in brackets.
    initial_lexer_fuel: int = 50_000  # building the lexer and the first mask's forced bytes [1,000,000]
    step_lexer_fuel: int = 20_000  # lexer work for one mask [200,000]
    step_max_items: int = 50_000  # Earley items per mask [50,000]
    max_lexer_states: int = 50_000  # ~1-2 kB each [250,000]
    max_grammar_size: int = 200_000  # symbols in the grammar's productions [500,000]
    # The worker's pool that compiles off the engine thread (async_engine.py). Each compile is bounded
    # by the above; more threads compile more grammars at once but leave the engine less CPU.
    compile_threads: int = 2


LIMITS = GrammarLimits()


# --- the constraint a request carries -----------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `spec` is normalised so that equal constraints compare and
    hash equal: a schema becomes its compact JSON text (key order kept: it is the order in which
    properties are generated), a choice a tuple of strings.

    kind: "json_object" (spec None), "json_schema" (a dict or JSON text), "regex" (a pattern the
    whole output must match) or "choice" (the output is exactly one of the strings).
    """

    kind: str
    spec: str | tuple[str, ...] | None = None
    key: str = field(init=False, repr=False, compare=False)
    # (compiler, compiled grammar) once GrammarCompiler.prepare compiled it (off the engine thread)
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"{PARAM}: unknown constraint kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        object.__setattr__(self, "spec", _normalise(self.kind, self.spec))
        payload = json.dumps(list(self.spec)) if self.kind == "choice" else str(self.spec or "")
        digest = hashlib.sha256(f"{self.kind}\0{payload}".encode()).hexdigest()[:32]
        object.__setattr__(self, "key", f"{self.kind}:{digest}")

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (json_schema only)."""
        return json.loads(self.spec) if self.kind == "json_schema" else None

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> Constraint | None:
        """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise GrammarError(f"{PARAM}: must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise GrammarError(f"{PARAM}: json_schema.schema is required")
            return cls("json_schema", inner["schema"])
        raise GrammarError(f"{PARAM}: type must be one of text, json_object, json_schema; got {kind!r}")


def _normalise(kind: str, spec: Any) -> str | tuple[str, ...] | None:
    if kind == "json_object":
        return None
    if kind == "json_schema":
        return _schema_text(spec)
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise GrammarError(f"{EXTENSION_PARAM}: regex must be a non-empty string")
        check_regex(spec, f"{EXTENSION_PARAM}: regex")
        return spec
    if isinstance(spec, str) or not isinstance(spec, Iterable):
        raise GrammarError(f"{EXTENSION_PARAM}: choice must be a list of strings")
    choices = tuple(spec)
    if len(choices) > LIMITS.max_choices:
        raise GrammarError(f"{EXTENSION_PARAM}: choice: too many choices ({len(choices)}; max {LIMITS.max_choices})")
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"{EXTENSION_PARAM}: choice must list at least one non-empty string")
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices)
    if size > LIMITS.max_choice_bytes:
        raise GrammarError(f"{EXTENSION_PARAM}: choice: the choices are too long together "
                           f"({size} bytes; max {LIMITS.max_choice_bytes})")
    return choices


def _schema_text(spec: Any) -> str:
    if isinstance(spec, str | bytes):
        size = len(spec.encode("utf-8", "surrogatepass") if isinstance(spec, str) else spec)
        if size > LIMITS.max_schema_bytes:
            raise GrammarError(f"{PARAM}: the JSON schema is too large ({size} bytes; max {LIMITS.max_schema_bytes})")
        try:
            spec = json.loads(spec)
        except RecursionError:
            raise GrammarError(f"{PARAM}: the JSON schema is nested too deeply "
                               f"(max {LIMITS.max_schema_depth} levels)") from None
        except ValueError as exc:
            raise GrammarError(f"{PARAM}: the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise GrammarError(f"{PARAM}: the JSON schema must be a JSON object")
    _check_schema(spec)
    text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > LIMITS.max_schema_bytes:
        raise GrammarError(f"{PARAM}: the JSON schema is too large ({size} bytes; max {LIMITS.max_schema_bytes})")
    return text


def _check_schema(schema: dict) -> None:
    """Depth, iteratively (before anything recursive sees it), and every regex in it: `pattern`
    values and `patternProperties` keys are regexes llguidance compiles like a regex constraint."""
    stack: list[tuple[Any, int, str | None]] = [(schema, 1, None)]
    while stack:
        node, depth, key = stack.pop()
        if isinstance(node, dict | list) and depth > LIMITS.max_schema_depth:
            raise GrammarError(f"{PARAM}: the JSON schema is nested too deeply (max {LIMITS.max_schema_depth} levels)")
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], f"{PARAM}: JSON schema pattern")
            if key == "patternProperties":
                for pattern in node:
                    check_regex(pattern, f"{PARAM}: JSON schema patternProperties")
            stack.extend((value, depth + 1, name) for name, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, depth + 1, None) for value in node)


def check_regex(pattern: str, where: str) -> None:
    """GrammarError (prefixed with `where`, the field) if the pattern is over a size bound."""
    if len(pattern) > LIMITS.max_regex_chars:
        raise GrammarError(f"{where}: the pattern is too long ({len(pattern)} characters; "
                           f"max {LIMITS.max_regex_chars})")
    repeat = regex_repeat(pattern)
    if repeat > LIMITS.max_regex_repeat:
        raise GrammarError(f"{where}: counted repetitions multiply to {repeat} repeats "
                           f"(max {LIMITS.max_regex_repeat}); use * or + for long runs")


_COUNTED = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def regex_repeat(pattern: str) -> int:
    """The largest product of counted-repetition bounds along one nesting path of a regex (Rust
    regex syntax, llguidance's): (a{1000}){1000} is 10^6, a{5}b{7} is 7, [a-z]{2,5}(x|y{3}){4} is 12.
    `{n,}` counts n (its unbounded part is a loop, as cheap as * or +). A lexical scan, not a
    parser: escapes, classes (nested, as Rust allows) and groups are skipped over correctly, and
    anything malformed is left for llguidance to reject."""
    frames = [[1, 0]]  # per open group: [largest product inside it, product of the last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if i - 1 < n and pattern[i - 1] in "pPxuU" and i < n and pattern[i] == "{":
                end = pattern.find("}", i)
                i = n if end < 0 else end + 1
            frames[-1][1] = 1
            continue
        if c == "[":
            i = _class_end(pattern, i)
            frames[-1][1] = 1
            continue
        if c == "(":
            frames.append([1, 0])
        elif c == ")" and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        elif c == "|":
            frames[-1][1] = 0
        elif c == "{" and (m := _COUNTED.match(pattern, i)):
            low, comma, high = m.groups()
            bound = int(high) if comma and high else int(low)
            frames[-1][1] *= max(bound, 1)
            frames[-1][0] = max(frames[-1][0], frames[-1][1])
            i = m.end()
            continue
        elif c not in "*+?":
            frames[-1][1] = 1
        i += 1
    while len(frames) > 1:  # unclosed groups (llguidance will refuse the pattern anyway)
        inner = frames.pop()[0]
        frames[-1][0] = max(frames[-1][0], inner)
    return frames[0][0]


def _class_end(pattern: str, start: int) -> int:
    """The index just past the character class opening at `start` (nested classes included)."""
    depth, i, n = 0, start, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":  # a leading ] is literal
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


# --- compiling, once per distinct constraint ----------------------------------------------------------


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
_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice"}


def _refusal(constraint: Constraint, raw: str) -> str:
    """A compile-time refusal as the client sees it: llguidance's message when it describes the
    request's own mistake (a regex that does not parse, an unsupported schema keyword), a plain
    "too complex" when one of its bounds was hit, never an internal panic or parser dump."""
    lowered = raw.lower()
    where = f"{param_for(constraint.kind)}: {_NAMES[constraint.kind]}"
    too_complex = f"{where}: too large or complex for the grammar engine"
    if any(word in lowered for word in _INTERNAL):
        log.warning("grammar engine failed on %s: %s", constraint.key, _one_line(raw))
        return too_complex
    if any(word in lowered for word in _TOO_COMPLEX):
        log.info("grammar engine refused %s: %s", constraint.key, _one_line(raw))
        return f"{too_complex} (over its limits)"
    return f"{param_for(constraint.kind)}: {_what(constraint)}: {_one_line(raw)}"


# JSON between tokens: any JSON whitespace, but at most this much per gap (pretty-printing nested
# five deep with four-space indents fits). Unbounded, a small model can emit newlines until
# max_tokens; none at all would force compact JSON on models trained to pretty-print.
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


def _one_line(message: str) -> str:
    """The engine's message on one line: its first line, plus the "error: ..." line of a regex error
    (llguidance then draws the pattern with a caret, and appends the grammar and parser state)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by the grammar engine"
    line = lines[0]
    detail = next((x for x in lines[1:] if x.startswith("error:")), None)
    if line.endswith(":") and detail:
        line = f"{line} {detail.removeprefix('error:').strip()}"
    line = " ".join(line.split())
    return line if len(line) <= 300 else line[:297] + "..."


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


# --- a sequence's state --------------------------------------------------------------------------------


class GrammarState:
    """One sequence's position in its grammar: a copy of the compiled matcher (cheap). After a
    preemption (the engine recomputes) rebuild it with `replay(output_tokens)`.

    Terminated means the output is final: the grammar admits nothing more (EOS must follow) or EOS
    was accepted. From then on only EOS is allowed (and accepted, as a no-op). A matcher that gives
    up (llguidance's error state: a fuel bound hit mid-output) or whose mask allows nothing is
    *failed* (`failure`): its mask then allows only EOS, so that sampling stays defined, but the
    output does not satisfy the constraint and the engine must end it as an error, never a `stop`.
    """

    def __init__(self, compiler: GrammarCompiler, compiled, constraint: Constraint | None = None) -> None:
        self.compiler = compiler
        self.constraint = constraint
        self._compiled = compiled
        self.matcher = compiled.deep_copy()
        self._idle_eos = 0  # EOS accepted after termination: allowed, but the matcher takes no more
        self._accepted = 0
        self._failed: str | None = None  # why the mask could not be computed (llguidance's words)
        # JSON outputs: the keys of the open objects and the number being written (json_guard.py)
        json_kind = constraint is not None and constraint.kind in JSON_KINDS
        self.tracker = JsonTracker() if json_kind else None
        self._tokens: list[int] = []  # accepted tokens (the tracker is rebuilt from them on rollback)
        self._dead_end: str | None = None  # why only the tracker's blocking emptied the mask

    @property
    def failure(self) -> str | None:
        """None while the state is healthy; else the plain message the request ends with (naming
        the request field; llguidance's own text is logged, not returned)."""
        if self._failed is None and not self.matcher.is_error():
            return None
        self.fail(self.matcher.get_error() if self.matcher.is_error() else "")
        if self.constraint is None:
            where = PARAM
        else:
            where = f"{param_for(self.constraint.kind)}: {_NAMES[self.constraint.kind]}"
        if self._dead_end:
            return f"{where}: after {self._accepted} output tokens {self._dead_end}; the output was discarded"
        return (f"{where}: the grammar engine gave up on this constraint after {self._accepted} output tokens "
                f"(too complex to enforce); the output was discarded")

    def refusal(self, token_id: int) -> str:
        """The message for a sampled token the grammar refused (the mask should have prevented it)."""
        where = param_for(self.constraint.kind) if self.constraint is not None else PARAM
        return self.failure or f"{where}: token {token_id} broke the constraint after {self._accepted} output tokens"

    def fail(self, reason: str) -> None:
        if self._failed is None:
            log.info("grammar state failed after %d tokens: %s", self._accepted, _one_line(reason))
            self._failed = reason
            if self.constraint is not None:
                self.compiler.forget(self.constraint, self._compiled)

    def allowed_mask_into(self, target: torch.Tensor) -> None:
        """Writes the allowed next tokens: into a contiguous CPU int32 bitmask row (ceil(V/32) words;
        bit j of word w is token 32w+j), or onto a float logits row ([V], any device), whose
        disallowed entries become -inf."""
        if target.dtype == torch.int32:
            words = self.compiler.eos_mask.numel()
            if target.device.type != "cpu" or not target.is_contiguous() or target.numel() != words:
                raise ValueError(f"a bitmask row must be a contiguous CPU tensor of {words} int32 words")
            if self.is_terminated() or self._failed:
                target.copy_(self.compiler.eos_mask)
            else:
                self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
                _apply_json_guard([self], target.view(1, -1))
                _check_rows([self], target.view(1, -1))
            return
        bitmask = new_bitmask(1, self.compiler.vocab_size)
        self.allowed_mask_into(bitmask[0])
        apply_token_bitmask_(target.view(1, -1), bitmask.to(target.device))

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged, unless the matcher gave up: see
        `failure`) if the grammar does not allow it here."""
        if not 0 <= token_id < self.compiler.vocab_size or self._failed:
            return False  # (llguidance would enter its error state)
        if self.matcher.is_stopped():
            allowed = token_id in self.compiler.eos_token_ids and not self.matcher.is_error()
            self._idle_eos += allowed
            return allowed
        if self.tracker is not None and token_id in self.tracker.blocked(self.compiler.token_index()):
            return False  # it would repeat a key or overrun a number (the mask never offers it)
        # try_consume_tokens refuses without entering the error state, unlike consume_token (a
        # fuel bound hit while consuming does enter it).
        accepted = self.matcher.try_consume_tokens([token_id]) == 1
        self._accepted += accepted
        if accepted:
            self._took([token_id])
        return accepted

    def _took(self, tokens: Sequence[int]) -> None:
        """Accepted tokens go to the JSON tracker (EOS ends the text: its bytes are not JSON)."""
        if self.tracker is None:
            return
        self._tokens.extend(tokens)
        token_bytes = self.compiler.token_index().token_bytes
        eos = self.compiler.eos_token_ids
        for t in tokens:
            if t not in eos:
                self.tracker.feed(token_bytes[t])

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (cheap: llguidance keeps the history)."""
        idle = min(num_tokens, self._idle_eos)
        self._idle_eos -= idle
        if num_tokens > idle and not self.matcher.rollback(num_tokens - idle):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {_one_line(self.matcher.get_error())}")
        self._accepted = max(0, self._accepted - (num_tokens - idle))
        if self.tracker is not None and num_tokens > idle:
            kept = self._tokens[:len(self._tokens) - (num_tokens - idle)]
            self.tracker, self._tokens = JsonTracker(), []
            self._took(kept)

    def reset(self) -> None:
        """Back to the start (a fresh copy, which also leaves any error state behind)."""
        self.matcher = self._compiled.deep_copy()
        self._idle_eos = 0
        self._accepted = 0
        self._failed = None
        self._dead_end = None
        if self.tracker is not None:
            self.tracker, self._tokens = JsonTracker(), []

    def replay(self, tokens: Sequence[int]) -> bool:
        """Resets, then accepts `tokens` (a preempted sequence's output so far). False if one is
        refused; the state then holds the tokens before it."""
        self.reset()
        tokens = [int(t) for t in tokens]
        in_range = next((i for i, t in enumerate(tokens) if not 0 <= t < self.compiler.vocab_size), len(tokens))
        if self.tracker is not None:  # one token at a time: each must also pass the tracker's check
            return all(self.accept(t) for t in tokens)
        done = self.matcher.try_consume_tokens(tokens[:in_range])  # one call for the bulk of them
        self._accepted = done
        return all(self.accept(t) for t in tokens[done:])


# --- masks for a batch -----------------------------------------------------------------------------------


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask, the layout both xgrammar and llguidance fill."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bitmask_of(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing exactly `token_ids`."""
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    for t in set(token_ids):
        row[t >> 5] |= 1 << (t & 31)
    return torch.where(row >= 1 << 31, row - (1 << 32), row).to(torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] (any device) -inf where bitmask [R, >= ceil(V/32)] (same device) has a 0 bit.
    Vectorised torch rather than an engine kernel: on CPU it measured faster than xgrammar's C++
    kernel, and on a GPU it needs no Triton JIT on first use."""
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words cannot cover {logits.shape[-1]} logits")
    bits = _BITS.to(bitmask.device)
    blocked = (bitmask.unsqueeze(-1) & bits).eq(0).flatten(-2)[..., : logits.shape[-1]]
    logits.masked_fill_(blocked, float("-inf"))


def fill_bitmasks(states: Sequence[GrammarState]) -> torch.Tensor:
    """One bitmask row per state, filled in one multi-threaded llguidance call per compiler (a batch
    normally has one, and all must share the model's vocab size). A terminated state's row allows
    only its EOS tokens."""
    sizes = {s.compiler.vocab_size for s in states}
    if len(sizes) != 1:
        raise ValueError(f"states of one batch must share a vocab size, got {sorted(sizes)}")
    bitmask = new_bitmask(len(states), sizes.pop())
    groups: dict[int, tuple[GrammarCompiler, list[tuple[Any, int]]]] = {}
    for i, state in enumerate(states):
        if state.is_terminated() or state._failed:
            bitmask[i] = state.compiler.eos_mask
        else:
            groups.setdefault(id(state.compiler), (state.compiler, []))[1].append((state.matcher, i))
    row_bytes = bitmask.shape[1] * 4
    for compiler, pairs in groups.values():
        compiler.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
    _apply_json_guard(states, bitmask)
    _check_rows(states, bitmask)
    return bitmask


def _apply_json_guard(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
    """Clears, in the rows llguidance filled, what the JSON tracker blocks (json_guard.py): tokens
    that would close an open key as one its object already holds, or write more of a number that is
    full. A row this leaves empty fails with its own message rather than "too complex"."""
    for i, state in enumerate(states):
        if state.tracker is None or state.is_terminated() or state._failed:
            continue
        blocked = state.tracker.blocked(state.compiler.token_index())
        if not blocked:
            continue
        row = bitmask[i]
        if not bool(row.any()):
            continue  # already empty: llguidance's own failure
        row &= ~bitmask_of(blocked, state.compiler.vocab_size)
        if not bool(row.any()):
            state._dead_end = (f"the schema requires a number longer than {MAX_NUMBER_CHARS} characters"
                               if state.tracker.number_full() else
                               "every key the schema allows here repeats one already in its object "
                               "(JSON keys must differ)")


def _check_rows(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
    """After computing masks: a state whose matcher gave up (a fuel bound) or whose row allows no
    token at all is marked failed, and its row allows only EOS, so the sampler still has a token
    to draw; the engine then ends that sequence as an error (`GrammarState.failure`)."""
    empty = set(bitmask.eq(0).all(dim=1).nonzero().flatten().tolist())
    for i, state in enumerate(states):
        if state.matcher.is_error() or i in empty:
            state.fail(state.matcher.get_error() if state.matcher.is_error() else "the mask allows no token")
            bitmask[i] = state.compiler.eos_mask


def apply_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """In place: row i of logits ([S, V]) keeps only what states[i] allows; rows whose state is None
    are untouched. One bitmask for the constrained rows, one transfer, one vectorised fill."""
    if len(states) != logits.shape[0]:
        raise ValueError(f"{len(states)} states for {logits.shape[0]} logits rows")
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    bitmask = fill_bitmasks([states[i] for i in rows])
    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        apply_token_bitmask_(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index)
    apply_token_bitmask_(constrained, bitmask)
    logits.index_copy_(0, index, constrained)
