"""The JSON text of the inference answers, written piece by piece so the event loop never waits on it.

A large answer is very large: n=128 choices of 900 tokens with 20 top logprobs each name 2.3
million alternatives, about 150 MB of JSON. Built as dicts once the stream had ended, decoded token
by token, and encoded in one `json.dumps`, it held the gateway's event loop for tens of seconds:
`/healthz` and every other tenant's request waited (issue 29). So:

- each message's logprobs become JSON text when the message arrives, between two reads of the
  worker stream (each read gives the loop back); a message carrying many tokens (a long prompt's
  logprobs, with echo) is written `SLICE` tokens at a time, giving the loop back in between;
- a token's text and its JSON (`TokenJson`) are written once per request and looked up after that;
  the token's text itself is decoded once per tokenizer (`TextTokenizer.token_text`);
- the whole answer goes out as pieces (`PiecewiseJSONResponse`): a send of about `SEND_BYTES`,
  then the loop's turn, then the next; its Content-Length is known, as before.

The text is what `json.dumps` of the same dicts gave, byte for byte: compact and non-ASCII as is for
a whole answer (Starlette's JSONResponse), `json.dumps`'s defaults for a stream's chunks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from starlette.responses import Response

from inferplane.api.tokenizer import TextTokenizer

SLICE = 256  # tokens written between two turns of the loop (each with up to 20 alternatives)
SEND_BYTES = 1 << 20  # bytes of a whole answer per send; the loop gets a turn between sends

_float_repr = float.__repr__  # what json.dumps writes for a finite float


class JsonStyle:
    """How `json.dumps` would write a value: Starlette's JSONResponse (compact, non-ASCII kept, no
    NaN) for whole answers, `json.dumps`'s defaults for server-sent event chunks."""

    def __init__(self, compact: bool) -> None:
        if compact:
            self.encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            self.item, self.key = ",", ":"
        else:
            self.encoder = json.JSONEncoder()
            self.item, self.key = ", ", ": "
        self.dumps: Callable[[Any], str] = self.encoder.encode
        self.compact = compact

    def number(self, value: float) -> str:
        text = _float_repr(value)
        # Only inf, -inf and nan have an "n": json.dumps writes those its own way (or refuses them).
        return self.dumps(value) if "n" in text else text

    def numbers(self, values: Iterable[float]) -> str:
        """The values comma-separated (the inside of a JSON array)."""
        text = self.item.join(map(_float_repr, values))
        return self.item.join(map(self.number, values)) if "n" in text else text

    def obj(self, pairs: Iterable[tuple[str, str]]) -> str:
        """An object from (ASCII key, value already JSON) pairs, in order."""
        return "{" + self.item.join(f'"{k}"{self.key}{v}' for k, v in pairs) + "}"

    def field(self, key: str) -> str:
        """`"key": ` as this style writes it, to open a value written separately."""
        return f'"{key}"{self.key}'


def joined(sep: str, parts: Iterable[str]) -> str:
    """The non-empty parts, sep between them: runs of array items, some of them empty."""
    return sep.join(p for p in parts if p)


class TokenJson:
    """A request's token ids as JSON fragments, each written once: its text (as the tokenizer
    decodes it alone, special tokens included) and the pieces of OpenAI's logprob entries."""

    def __init__(self, tokenizer: TextTokenizer, style: JsonStyle) -> None:
        self.tokenizer = tokenizer
        self.style = style
        self._keys: dict[int, tuple[str, int]] = {}
        self._entries: dict[int, tuple[str, str, str]] = {}

    def text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def key(self, token_id: int) -> tuple[str, int]:
        """(the token's text as a JSON string, its length in characters)."""
        found = self._keys.get(token_id)
        if found is None:
            text = self.text(token_id)
            found = self._keys[token_id] = (self.style.dumps(text), len(text))
        return found

    def entry(self, token_id: int) -> tuple[str, str, str]:
        """A chat logprob entry around its logprob: (`{"token": t, "logprob": `, `, "bytes": [..]}`,
        `, "bytes": [..], "top_logprobs": [`), the last to open the token's own alternatives."""
        found = self._entries.get(token_id)
        if found is None:
            s = self.style
            text = self.text(token_id)
            head = "{" + s.field("token") + s.dumps(text) + s.item + s.field("logprob")
            tail = s.item + s.field("bytes") + s.dumps(list(text.encode()))
            found = self._entries[token_id] = (head, tail + "}", tail + s.item + s.field("top_logprobs") + "[")
        return found


async def in_slices(count: int, write: Callable[[int, int], str], sep: str) -> str:
    """write(start, stop) over [0, count) in SLICE-sized runs, joined by sep; the loop gets a turn
    between runs, so a message of thousands of tokens is no single long stretch."""
    if count <= SLICE:
        return write(0, count)
    parts = []
    for start in range(0, count, SLICE):
        if start:
            await asyncio.sleep(0)
        parts.append(write(start, min(start + SLICE, count)))
    return joined(sep, parts)


class PiecewiseJSONResponse(Response):
    """A JSON body already written as byte pieces, sent SEND_BYTES at a time with the loop's turn
    in between (one send, as JSONResponse did, for a body that small)."""

    media_type = "application/json"

    def __init__(self, pieces: Sequence[bytes], status_code: int = 200) -> None:
        self.pieces = pieces
        self.length = sum(map(len, pieces))
        super().__init__(None, status_code=status_code, headers={"content-length": str(self.length)})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        batch: list[bytes] = []
        size = 0
        for piece in self.pieces:
            if size and size + len(piece) > SEND_BYTES:
                await send({"type": "http.response.body", "body": b"".join(batch), "more_body": True})
                await asyncio.sleep(0)
                batch, size = [], 0
            batch.append(piece)
            size += len(piece)
        await send({"type": "http.response.body", "body": b"".join(batch)})
