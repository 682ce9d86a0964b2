"""The chat completions' answer read back, for the APIs served through chat (Anthropic's Messages,
OpenAI's Responses): their routes call `Completions.chat` and translate what it returns, so a
streamed answer is parsed from its server-sent events and a whole one from its JSON body here, once.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response


async def chat_stream_items(pieces: AsyncIterator[str | bytes]) -> AsyncIterator[dict[str, Any] | str]:
    """Each chunk of a chat completion stream as a dict (an error chunk too: `{"error": ...}`), and
    each comment line block (the keep-alive sent while the request is queued) as its raw text, in
    order; `[DONE]` is dropped. Bytes are decoded incrementally, so a character split between two
    pieces is read whole."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffered = ""
    async for piece in pieces:
        buffered += decoder.decode(piece) if isinstance(piece, bytes) else piece
        while "\n\n" in buffered:
            raw, buffered = buffered.split("\n\n", 1)
            if raw.startswith(":"):
                yield raw + "\n\n"
                continue
            data = "".join(line[6:] for line in raw.split("\n") if line.startswith("data: "))
            if data and data != "[DONE]":
                yield json.loads(data)


def response_body(response: Response) -> bytes:
    """A whole (non-streamed) answer's body, also where it was built in pieces (PiecewiseJSONResponse)."""
    pieces = getattr(response, "pieces", None)
    if pieces is not None:
        return b"".join(pieces)
    return bytes(response.body)
