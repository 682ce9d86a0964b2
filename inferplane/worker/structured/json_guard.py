"""What a grammar cannot say about the JSON a model writes: no object repeats a key, no number
runs on.

JSON Schema (and so llguidance, the grammar engine: compiler.py) lets an object hold properties it
does not declare unless `additionalProperties: false`, and a context-free grammar cannot say "every
key differs" for keys it does not list: llguidance writes each *declared* property at most once,
but undeclared (additional or pattern) keys may repeat. A small model then writes
`"description": ...` again and again until max_tokens (issue 53). Most parsers keep the last
duplicate, so the text would not even mean what was written. Likewise a JSON number has no length
bound, and the same model, once its keys were fixed, wrote `"lat":12.2231231231...` to max_tokens.

So beside the grammar, each JSON-constrained sequence carries a `JsonTracker` that reads its output
bytes as they are accepted: the open objects, the keys each one already holds (decoded: `\\n` and
`\\u000a` are the same key), inside a key the bytes written so far, and the length of a number
being written. Its `GrammarState` (state.py) then clears from the mask that llguidance filled:
- while a key is open, the tokens that would close it as one of its object's earlier keys. The
  tokens that can close a string are indexed once per tokenizer (`TokenIndex`: the decoded text
  before a token's closing quote -> its ids), so a step costs a dictionary lookup per earlier key
  of the object that starts with the open key's text;
- once a number has `MAX_NUMBER_CHARS` characters and ends in a digit, every token that would
  write more of it. 32 holds any float64 written in full (`-1.2345678901234567e-308` is 24) and any
  64-bit integer (20 digits).

What is guaranteed: a JSON output (json_schema, json_object) never holds two equal keys in one
object, at any depth, and no number in it is longer than MAX_NUMBER_CHARS characters. Where every
continuation the grammar allows would break one of these (a schema whose patternProperties admit
only keys already used; a number the schema requires to be larger), the mask is empty and the
request ends as an error naming why, never as invalid output. Regex and choice constraints are not
JSON and are not tracked.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

MAX_NUMBER_CHARS = 32
_QUOTE, _BACKSLASH = 0x22, 0x5C
_NUMBER_START = frozenset(b"-0123456789")
_NUMBER = frozenset(b"-+.eE0123456789")
_DIGITS = frozenset(b"0123456789")
_SIMPLE_ESCAPES = {ord('"'): b'"', ord("\\"): b"\\", ord("/"): b"/", ord("b"): b"\b", ord("f"): b"\f",
                   ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t"}
_HEX = frozenset(b"0123456789abcdefABCDEF")


class _BadEscape(ValueError):
    """Bytes that are not a JSON string's (the grammar never allows them; such a token is skipped)."""


def _scan_string(pending: bytes, data: bytes, start: int = 0) -> tuple[bytes, int | None, bytes]:
    """Reads `data[start:]` as the inside of a JSON string, after `pending` (an escape left open by
    earlier bytes, e.g. b"\\\\u00"). Returns (the decoded bytes, the index just past the closing quote
    or None if the string stays open, the escape left open at the end)."""
    out = bytearray()
    i, n = start, len(data)
    while i < n:
        if pending:
            pending += data[i:i + 1]
            i += 1
            if len(pending) == 2:
                if pending[1] == ord("u"):
                    continue
                if pending[1] not in _SIMPLE_ESCAPES:
                    raise _BadEscape(pending)
                out += _SIMPLE_ESCAPES[pending[1]]
                pending = b""
            else:
                if pending[-1] not in _HEX:
                    raise _BadEscape(pending)
                if len(pending) == 6:
                    out += chr(int(pending[2:], 16)).encode("utf-8", "surrogatepass")
                    pending = b""
            continue
        quote = data.find(b'"', i)
        slash = data.find(b"\\", i)
        if quote < 0 and slash < 0:
            out += data[i:]
            return bytes(out), None, b""
        if slash < 0 or 0 <= quote < slash:
            out += data[i:quote]
            return bytes(out), quote + 1, b""
        out += data[i:slash]
        pending = b"\\"
        i = slash + 1
    return bytes(out), None, pending


class TokenIndex:
    """One tokenizer's tokens as the tracker needs them: `closing` maps the decoded bytes a token
    writes before its first closing quote (reading it from inside a string, no escape open) to the
    token ids; `quoted` lists every token with a quote byte, for the rare step where an escape is
    open (its bytes then read differently); `number` every token that begins with a character a
    number can go on with."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self.token_bytes = token_bytes
        self.closing: dict[bytes, list[int]] = {}
        self.quoted: list[int] = []
        # tokens with two quotes or more: one may open and close a whole key (`""`, `,"id"`)
        self.whole = [t for t, data in enumerate(token_bytes) if data.count(b'"') >= 2]
        self.number = [t for t, data in enumerate(token_bytes) if data and data[0] in _NUMBER]
        for token, data in enumerate(token_bytes):
            if b'"' not in data:
                continue
            self.quoted.append(token)
            try:
                before, end, _ = _scan_string(b"", data)
            except _BadEscape:
                continue
            if end is not None:
                self.closing.setdefault(before, []).append(token)


class JsonTracker:
    """Where a JSON text being written stands, as far as keys and numbers go: the open containers (an
    object's keys so far, or None for an array), whether a string is open, is a key, and what it
    holds, and how long the number being written is."""

    def __init__(self) -> None:
        self._stack: list[set[bytes] | None] = []
        self._expect_key = False  # inside an object, before a key (after "{" or ",")
        self._in_string = False
        self._is_key = False
        self._key = bytearray()  # the open key's decoded bytes
        self._pending = b""  # an escape the last bytes left open
        self._number = 0  # characters of the number being written (0: none)
        self._number_ends_in_digit = False
        self.repeated: bytes | None = None  # a key written twice (only if tokens bypassed the mask)

    def feed(self, data: bytes) -> None:
        """Reads the next output bytes (a valid JSON prefix: the grammar saw to that)."""
        i, n = 0, len(data)
        while i < n:
            if self._in_string:
                try:
                    decoded, end, self._pending = _scan_string(self._pending, data, i)
                except _BadEscape:
                    decoded, end, self._pending = b"", None, b""
                if self._is_key:
                    self._key += decoded
                if end is None:
                    return
                self._close_string()
                i = end
                continue
            byte = data[i]
            i += 1
            if byte in (_NUMBER if self._number else _NUMBER_START):
                self._number += 1
                self._number_ends_in_digit = byte in _DIGITS
                continue
            self._number = 0
            if byte == _QUOTE:
                self._in_string = True
                self._is_key = self._expect_key and bool(self._stack) and self._stack[-1] is not None
                self._key.clear()
                self._pending = b""
            elif byte == ord("{"):
                self._stack.append(set())
                self._expect_key = True
            elif byte == ord("["):
                self._stack.append(None)
                self._expect_key = False
            elif byte in (ord("}"), ord("]")):
                if self._stack:
                    self._stack.pop()
                self._expect_key = False
            elif byte == ord(","):
                self._expect_key = bool(self._stack) and self._stack[-1] is not None
            elif byte == ord(":"):
                self._expect_key = False

    def _close_string(self) -> None:
        self._in_string = False
        if self._is_key:
            keys = self._stack[-1]
            assert keys is not None
            key = bytes(self._key)
            if key in keys and self.repeated is None:
                self.repeated = key
            keys.add(key)
            self._is_key = False
            self._expect_key = False

    def number_full(self) -> bool:
        """Whether the number being written has all the characters it may have (and is whole)."""
        return self._number >= MAX_NUMBER_CHARS and self._number_ends_in_digit

    def blocked(self, index: TokenIndex) -> Iterable[int]:
        """The tokens that would now close the open key as one its object already holds, write a
        whole key its object holds (a token with an opening and a closing quote, such as `""`), or
        write more of a number that is full."""
        if self.number_full():
            return index.number
        if not any(self._stack):  # no object holds a key yet: nothing can repeat
            return ()
        whole = [t for t in index.whole if self._would_repeat(index.token_bytes[t])]
        if not (self._in_string and self._is_key):
            return whole
        keys = self._stack[-1]
        if not keys:
            return whole
        if self._pending:  # an escape is open: read each quote-bearing token from here (rare)
            return [t for t in index.quoted if self._closes_as_used(index.token_bytes[t], keys)]
        key = bytes(self._key)
        size = len(key)
        return whole + [t for used in keys if used.startswith(key) for t in index.closing.get(used[size:], ())]

    def _would_repeat(self, data: bytes) -> bool:
        """Whether writing `data` next would repeat a key (read on a copy of this state)."""
        probe = copy.copy(self)
        probe._stack = [None if keys is None else set(keys) for keys in self._stack]
        probe._key = bytearray(self._key)
        probe.repeated = None
        probe.feed(data)
        return probe.repeated is not None

    def _closes_as_used(self, data: bytes, keys: set[bytes]) -> bool:
        try:
            decoded, end, _ = _scan_string(self._pending, data)
        except _BadEscape:
            return False
        return end is not None and bytes(self._key) + decoded in keys
