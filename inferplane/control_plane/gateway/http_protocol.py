"""uvicorn's httptools protocol with two bounds on every request head: its size and how long it takes.

Why a subclass: uvicorn has neither bound for httptools, the implementation it picks when httptools
is installed (uvicorn[standard] installs it). llhttp hands a header to Python only once it is
complete, and httptools concatenates its pieces meanwhile, so one client could make the gateway
buffer a 32 MiB header before authentication (answered 200), and four connections' 64 MiB of
unfinished headers took it from 224 to 575 MB, kept after they closed (issue 53). uvicorn's only
timer is keep-alive, armed after a response: a connection that opens and dribbles a header a byte
at a time is never closed. h11, uvicorn's other implementation, bounds the size
(`h11_max_incomplete_event_size`) but not the time, and is pure Python: several times the
gateway's CPU per request. So httptools stays, and the bytes are counted before they reach it:

- size: the bytes of a head (request line and headers) are counted as they arrive; once more than
  `max_head_bytes` have come without the head ending, the client gets a 431 (OpenAI's error body,
  `Connection: close`) and the connection is closed, the rest never parsed. A head that begins in
  the same read as the previous request ends (pipelining) is counted from the next read on: at
  most one read's bytes (uvicorn's transports read 256 KiB at a time) beyond the bound.
- trailers: a chunked body's trailer fields go through the same header buffer, after the head, where
  the body limit (which counts body bytes) never sees them. So the count goes on past the head: more
  than `max_head_bytes` arriving with no body byte, head end or message end among them is a 431 too.
  Bodies themselves pass (each body byte resets the count); the middleware bounds them.
- time: a head must be complete `head_timeout` seconds after its first byte. Before that byte the
  connection is idle and waits as long as a kept-alive one does (uvicorn's keep-alive timeout, 75 s
  in the gateway), so a proxy that opens connections ahead of use does not race a close; an idle
  connection is then closed without a word. A head not complete in time is a 408 and a close.

After a 431 or 408 the gateway stops sending (FIN) and drops what still arrives for at most
LINGER_SECONDS and LINGER_BYTES, then closes, as nginx's lingering close does: closing a socket at
once with the client's bytes unread makes the kernel reset the connection, and the client loses the
answer it had not read yet.

A body is bounded elsewhere (`middleware.LimitsAndMetrics`, which counts what the app reads).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from inferplane.control_plane.gateway.errors import error_body

DEFAULT_MAX_HEAD_BYTES = 64 << 10  # nginx takes 32 KiB of headers by default, Node 16 KiB: ample for a key or JWT
DEFAULT_HEAD_TIMEOUT = 10.0  # seconds; a client sends its head in one write, bar a very slow link
LINGER_SECONDS = 1.0
# A client that wrote a head up to twice the bound in one go still reads its 431. More costs the
# loop: with 64 connections sending 64 MiB heads over and over, a megabyte of lingering per
# connection put another tenant's p95 at 98 ms, 64 KiB at 25 ms (alone: 9-12 ms).
LINGER_BYTES = 64 << 10


class BoundedHeadProtocol(HttpToolsProtocol):
    """See the module docstring. `bounded_head_protocol` makes a subclass with the gateway's bounds,
    since uvicorn builds the protocol itself from the class it is given."""

    max_head_bytes = DEFAULT_MAX_HEAD_BYTES
    head_timeout = DEFAULT_HEAD_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._in_head = True  # the next bytes are a request head (or part of one)
        self._head_bytes = 0  # bytes since the last progress (body byte, head end, message end)
        self._progress = 0  # counts those events
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_left: int | None = None  # refused: the bytes still dropped before closing
        super().connection_made(transport)
        # idle until its first byte, as long as a kept-alive connection may be; on_message_begin
        # then gives the head its own bound
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:  # refused: what still comes is dropped
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.close()
            return
        while data and not self.transport.is_closing():
            room = self.max_head_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                super().data_received(data)
                return
            # More than a head (or trailers) may still take: some progress must come within `room` bytes.
            progress, in_head = self._progress, self._in_head
            self._head_bytes = self.max_head_bytes
            super().data_received(data[:room])
            if self._progress == progress:
                if self.transport.is_closing():  # the parser refused the bytes itself (a 400)
                    return
                what = "request headers" if in_head else "request trailers"
                self._refuse(431, f"{what} over {self.max_head_bytes} bytes", "request_header_fields_too_large")
                return
            data = data[room:]  # progress: the rest is body, trailers or the next request

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._stop_head_timer()  # its first byte came: the head has its own bound from now
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._progress += 1
        self._head_bytes = 0
        self._stop_head_timer()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._progress += 1
        self._head_bytes = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._progress += 1
        super().on_message_complete()

    # The bounds' answers

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(408, f"request headers not complete within {self.head_timeout:g} s", "request_timeout")
        else:  # nothing sent: no request to answer
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answers `status` and closes; with a response of the connection's still going out
        (pipelining), closes without a word, which is all that can be done there."""
        self._stop_head_timer()
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(error_body(status, message, code)).encode()
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                     b"\r\nconnection: close\r\n\r\n", body]
            self.transport.write(b"".join(head))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self._linger_left = LINGER_BYTES
                self.loop.call_later(LINGER_SECONDS, self.transport.close)
                return
        self.transport.close()


def bounded_head_protocol(max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                          head_timeout: float = DEFAULT_HEAD_TIMEOUT) -> type[BoundedHeadProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`) for these bounds."""
    if max_head_bytes < 1 or head_timeout <= 0:
        raise ValueError("max_head_bytes and head_timeout must be positive")
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,),
                {"max_head_bytes": max_head_bytes, "head_timeout": head_timeout})
