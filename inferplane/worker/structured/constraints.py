"""The constraint a request carries, and the bounds every constraint is held to.

A `Constraint` is what a request asks its output to match: any JSON object, a JSON schema, a regex
or one of a list of choices. It is normalised when the request is parsed, so equal constraints
compare and hash equal (the compiler's cache key), and it is checked there against `LIMITS`: the
number and bytes of choices, a regex's length and how far its counted repetitions multiply, a
schema's bytes and depth, and its patterns like regexes. A constraint over a bound is a
`GrammarError`, a 400 naming the request field; nothing here compiles anything or imports
llguidance, so the gateway-facing checks stay cheap.

Bounds live in one place (`GrammarLimits`): the size bounds above and llguidance's fuel limits
(`LLParserLimits`, applied by the compiler) so that neither compiling nor one mask can run for
seconds. Whatever llguidance itself refuses or gives up on becomes a plain GrammarError naming the
request field, never its internal text (a Rust panic, parser state): `one_line` is how its words
are shortened for a client or a log line.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inferplane.api.grammar_limits import MAX_CONSTRAINT_CHOICES, MAX_REGEX_CHARS

KINDS = ("json_object", "json_schema", "regex", "choice")
JSON_KINDS = ("json_object", "json_schema")
PARAM = "response_format"
EXTENSION_PARAM = "structured_outputs"  # regex and choice come from vLLM's extension, not response_format


def param_for(kind: str) -> str:
    """The request field an error about a `kind` constraint names."""
    return EXTENSION_PARAM if kind in ("regex", "choice") else PARAM


# How an error message names each kind of constraint.
KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice"}


class GrammarError(ValueError):
    """A constraint the request got wrong; the message is one line naming the request parameter."""


def one_line(message: str) -> str:
    """The grammar engine's message on one line: its first line, plus the "error: ..." line of a regex error
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
