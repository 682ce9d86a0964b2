"""Structured outputs: constraining sampling to a JSON schema, any JSON object, a regex or a choice.

A request's `Constraint` compiles once per model (`GrammarCompiler`, an LRU cache) into a grammar;
each sequence then owns a `GrammarState` that says which tokens may come next. `apply_masks` sets
the logits of every other token to -inf for a whole batch at once, before the sampler runs, so the
sampler (inferplane/worker/sampling.py) needs no change and its seeded draws stay batch-independent.

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
are rejected (GrammarError), not ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("json_object", "json_schema", "regex", "choice")
PARAM = "response_format"
EXTENSION_PARAM = "structured_outputs"  # regex and choice come from vLLM's extension, not response_format


def param_for(kind: str) -> str:
    """The request field an error about a `kind` constraint names."""
    return EXTENSION_PARAM if kind in ("regex", "choice") else PARAM

_BITS = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32), torch.arange(32, dtype=torch.int32))


class GrammarError(ValueError):
    """A constraint the request got wrong; the message is one line naming the request parameter."""


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
        return spec
    if isinstance(spec, str) or not isinstance(spec, Iterable):
        raise GrammarError(f"{EXTENSION_PARAM}: choice must be a list of strings")
    choices = tuple(spec)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"{EXTENSION_PARAM}: choice must list at least one non-empty string")
    return choices


def _schema_text(spec: Any) -> str:
    if isinstance(spec, str | bytes):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise GrammarError(f"{PARAM}: the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise GrammarError(f"{PARAM}: the JSON schema must be a JSON object")
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


# --- compiling, once per distinct constraint ----------------------------------------------------------


@functools.cache
def _ll():
    """llguidance, imported on first use so that a worker serving no structured output never loads it.
    (Not `llguidance.torch`: it wraps a function in torch.compile at import, seconds of start-up.)"""
    import llguidance

    return llguidance


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; keeps the last `cache_size` compiled grammars.

    `tokenizer`: a `TextTokenizer` (its EOS is the default) or a `tokenizers.Tokenizer`; llguidance
    reads the tokenizer's own JSON (no transformers needed), special tokens included, which it never
    lets a grammar's text use. `vocab_size`: the model's (the logits' width), which may exceed the
    tokenizer's; ids past the tokenizer's are never allowed. `eos_token_ids`: the tokens that may
    (and, once the grammar is complete, must) end the output. `threads`: for filling a batch's masks
    (None: llguidance's default, 80% of the CPUs up to 32).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None, *,
                 cache_size: int = 64, threads: int | None = None) -> None:
        ll = _ll()
        self.vocab_size = vocab_size
        self.eos_token_ids = _eos_ids(tokenizer, eos_token_ids, vocab_size)
        tok = getattr(tokenizer, "tokenizer", tokenizer)  # TextTokenizer → tokenizers.Tokenizer
        self.ll_tokenizer = ll.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self.executor = ll.LLExecutor(num_threads=threads)
        self.eos_mask = bitmask_of(self.eos_token_ids, vocab_size)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint):
        """The compiled grammar: an llguidance matcher at the start state, never advanced itself
        (states are its copies), from the cache when there."""
        with self._lock:
            if constraint.key in self._cache:
                self._cache.move_to_end(constraint.key)
                return self._cache[constraint.key]
        compiled = self._compile(constraint)
        with self._lock:
            compiled = self._cache.setdefault(constraint.key, compiled)
            self._cache.move_to_end(constraint.key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, constraint: Constraint) -> GrammarState:
        """A sequence's state at the start of its output."""
        return GrammarState(self, self.compile(constraint))

    def _compile(self, constraint: Constraint):
        ll = _ll()
        try:
            grammar = _grammar(constraint)
        except ValueError as exc:
            raise GrammarError(f"{param_for(constraint.kind)}: {_what(constraint)}: {_one_line(str(exc))}") from None
        matcher = ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{param_for(constraint.kind)}: {_what(constraint)}: "
                               f"{_one_line(matcher.get_error())}")
        return matcher


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
    return {"json_schema": "invalid JSON schema", "regex": "invalid regex"}.get(constraint.kind, "invalid choice")


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
    was accepted. From then on only EOS is allowed (and accepted, as a no-op). A matcher that ever
    enters llguidance's error state counts as terminated too, so a sequence can only be ended, never
    be left with no allowed token at all.
    """

    def __init__(self, compiler: GrammarCompiler, compiled) -> None:
        self.compiler = compiler
        self._compiled = compiled
        self.matcher = compiled.deep_copy()
        self._idle_eos = 0  # EOS accepted after termination: allowed, but the matcher takes no more

    def allowed_mask_into(self, target: torch.Tensor) -> None:
        """Writes the allowed next tokens: into a contiguous CPU int32 bitmask row (ceil(V/32) words;
        bit j of word w is token 32w+j), or onto a float logits row ([V], any device), whose
        disallowed entries become -inf."""
        if target.dtype == torch.int32:
            words = self.compiler.eos_mask.numel()
            if target.device.type != "cpu" or not target.is_contiguous() or target.numel() != words:
                raise ValueError(f"a bitmask row must be a contiguous CPU tensor of {words} int32 words")
            if self.is_terminated():
                target.copy_(self.compiler.eos_mask)
            else:
                self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
            return
        bitmask = new_bitmask(1, self.compiler.vocab_size)
        self.allowed_mask_into(bitmask[0])
        apply_token_bitmask_(target.view(1, -1), bitmask.to(target.device))

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged) if the grammar does not allow it here."""
        if not 0 <= token_id < self.compiler.vocab_size:
            return False  # (llguidance would enter its error state)
        if self.matcher.is_stopped():
            allowed = token_id in self.compiler.eos_token_ids
            self._idle_eos += allowed
            return allowed
        # try_consume_tokens refuses without entering the error state, unlike consume_token.
        return self.matcher.try_consume_tokens([token_id]) == 1

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (cheap: llguidance keeps the history)."""
        idle = min(num_tokens, self._idle_eos)
        self._idle_eos -= idle
        if num_tokens > idle and not self.matcher.rollback(num_tokens - idle):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {_one_line(self.matcher.get_error())}")

    def reset(self) -> None:
        """Back to the start (a fresh copy, which also leaves any error state behind)."""
        self.matcher = self._compiled.deep_copy()
        self._idle_eos = 0

    def replay(self, tokens: Sequence[int]) -> bool:
        """Resets, then accepts `tokens` (a preempted sequence's output so far). False if one is
        refused; the state then holds the tokens before it."""
        self.reset()
        tokens = [int(t) for t in tokens]
        in_range = next((i for i, t in enumerate(tokens) if not 0 <= t < self.compiler.vocab_size), len(tokens))
        done = self.matcher.try_consume_tokens(tokens[:in_range])  # one call for the bulk of them
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
        if state.is_terminated():
            bitmask[i] = state.compiler.eos_mask
        else:
            groups.setdefault(id(state.compiler), (state.compiler, []))[1].append((state.matcher, i))
    row_bytes = bitmask.shape[1] * 4
    for compiler, pairs in groups.values():
        compiler.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
    return bitmask


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
