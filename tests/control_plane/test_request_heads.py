"""Issue 53, class 5: a request head (request line and headers) is bounded in size and in time.

Before, uvicorn's httptools protocol bounded neither: a 32 MiB header was answered 200, four
connections' 64 MiB of unfinished headers took the gateway from 224 to 575 MB and kept it, and a
connection dribbling a header a byte at a time stayed open for good. A real gateway on a loopback
port with small bounds, so that crossing them is quick: over the size bound the client gets a 431
(and the connection closes) while it is still sending, however the head grows (one long header,
many headers, a long URL); a head slower than the time bound is closed (a 408 when part of it came),
as is a connection that sends nothing. Heads within the bounds are served, a body arriving in the
same read as its head is not taken for header bytes, pipelined requests are served, and a
kept-alive connection idle between requests is kept (that wait is the keep-alive timer's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inferplane.bench.gateway_harness import free_port
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

HEAD_LIMIT = 8 << 10
HEAD_TIMEOUT = 1.0
KEEP_ALIVE = 5.0  # what an idle connection waits before its first byte (75 s in the gateway)
HUGE = 32 << 20  # what an unfinished head offers to grow to
CHUNK = 16 << 10
PATIENCE = 30.0  # how long a test waits for the gateway to act, 30 times its time bound


@pytest.fixture
async def port(tmp_path: Path) -> AsyncIterator[int]:
    port = free_port()
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=port,
                                      max_header_bytes=HEAD_LIMIT, header_timeout_seconds=HEAD_TIMEOUT,
                                      keep_alive_seconds=KEEP_ALIVE))
    await gateway.start()
    yield port
    await gateway.stop()


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One response: (status line, headers, body)."""
    status = await asyncio.wait_for(reader.readline(), PATIENCE)
    headers = {}
    while (line := await asyncio.wait_for(reader.readline(), PATIENCE)) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), PATIENCE)
    return status, headers, body


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (EOF or reset) within PATIENCE."""
    try:
        return await asyncio.wait_for(reader.read(1 << 16), PATIENCE) == b""
    except ConnectionError:
        return True


HEADS = {
    "one long header": b"GET /healthz HTTP/1.1\r\nhost: gw\r\nx-big: " + b"a" * (2 * HEAD_LIMIT) + b"\r\n\r\n",
    "many headers": b"GET /healthz HTTP/1.1\r\nhost: gw\r\n" + b"x-h: 0123456789\r\n" * (HEAD_LIMIT // 8) + b"\r\n",
    "a long url": b"GET /healthz?" + b"q" * (2 * HEAD_LIMIT) + b" HTTP/1.1\r\nhost: gw\r\n\r\n",
}


@pytest.mark.parametrize("name", list(HEADS))
async def test_a_head_over_the_bound_gets_431_and_the_connection_closes(port: int, name: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        with contextlib.suppress(ConnectionError):  # the server may close before it has read all of it
            writer.write(HEADS[name])
            await writer.drain()
        status, headers, body = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 431 "), status
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
        assert await _closed(reader)
    finally:
        writer.close()


@pytest.mark.parametrize("opening", [b"GET /healthz HTTP/1.1\r\nhost: gw\r\nx-big: ", b"GET /healthz?q="])
async def test_an_unfinished_head_is_refused_while_it_is_still_coming(port: int, opening: bytes) -> None:
    """The refusal comes after about the bound, not after the client gave up: nothing is buffered.
    This client never stops to read, so the gateway, having dropped a megabyte after its 431
    (lingering), closes with bytes unread and the kernel resets the connection; the client may
    see the reset before it reads the 431: either is the refusal."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(opening)
    sent = 0

    async def grow() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):
            while sent < HUGE:
                writer.write(b"a" * CHUNK)
                sent += CHUNK
                await writer.drain()
            # The head's end: a server that waited for it answers now.
            writer.write(b"\r\n\r\n" if b"x-big" in opening else b" HTTP/1.1\r\n\r\n")
            await writer.drain()

    sender = asyncio.create_task(grow())
    try:
        try:
            status = (await _answer(reader))[0]
        except ConnectionError:
            status = b"(reset)"
        sent_before_the_answer = sent
    finally:
        sender.cancel()
        writer.close()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
    assert status.startswith(b"HTTP/1.1 431 ") or status == b"(reset)", status
    assert sent_before_the_answer < HUGE // 4, sent_before_the_answer


async def test_chunked_trailers_over_the_bound_are_refused_while_they_still_come(port: int) -> None:
    """A chunked body's trailer fields go through the header buffer after the head (the review of
    issue 53's fix: a 10 MB trailer line was held whole, before authentication); they are counted
    as a head is, and a chunked body far over the bound with small trailers is still served."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = b"a" * (HEAD_LIMIT // 2)
    try:
        # a chunked body of 20 chunks (10 times the head bound) with one small trailer: read (401, no key)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 20 + b"0\r\nx-t: 1\r\n\r\n")
        assert (await _answer(reader))[0].startswith(b"HTTP/1.1 401 ")
        # then one whose trailer line never ends
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"1\r\nx\r\n0\r\nx-t: ")
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < HUGE // 4:
                writer.write(b"a" * CHUNK)
                sent += CHUNK
                await writer.drain()
        assert sent < HUGE // 4, f"the gateway still took trailer bytes after {sent}"
    finally:
        writer.close()


async def test_heads_within_the_bound_are_served_with_their_bodies_and_pipelined(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # A head just under the bound.
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\nx-big: " + b"a" * (HEAD_LIMIT - 100) + b"\r\n\r\n")
        assert (await _answer(reader))[0].startswith(b"HTTP/1.1 200 ")
        # A small head and a body far over the head bound in one write: the body is not header bytes
        # (no key: the body is read, then the 401).
        body = json.dumps({"model": "m", "prompt": "x" * (40 * HEAD_LIMIT)}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        assert (await _answer(reader))[0].startswith(b"HTTP/1.1 401 ")
        # Two requests in one write.
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\nGET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert (await _answer(reader))[0].startswith(b"HTTP/1.1 200 ")
        assert (await _answer(reader))[0].startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()


async def test_a_head_dribbled_slower_than_the_bound_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n")
    line = b"x-slow: " + b"a" * 1000

    async def dribble() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in line:  # a byte every 30 ms: PATIENCE is over before the header is
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(PATIENCE / len(line))
            writer.write(b"\r\n\r\n")  # a gateway that waited answers now
            await writer.drain()

    sender = asyncio.create_task(dribble())
    try:
        status, _, body = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 408 "), status
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert await _closed(reader)
        assert not sender.done()  # closed while the head was still coming
    finally:
        sender.cancel()
        writer.close()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender


async def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await _closed(reader)
    finally:
        writer.close()


async def test_a_new_connection_waits_for_its_first_byte_past_the_head_bound(port: int) -> None:
    """A proxy may open connections ahead of use: before its first byte a connection is idle, as a
    kept-alive one is, and is not closed at the head's bound (it was, in issue 53's first fix)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.sleep(3 * HEAD_TIMEOUT)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert (await _answer(reader))[0].startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()


async def test_a_kept_alive_connection_waits_for_its_next_request_past_the_head_bound(port: int) -> None:
    """The time bound runs from a request's first byte: the wait before it is keep-alive's (75 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(2):
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            assert (await _answer(reader))[0].startswith(b"HTTP/1.1 200 ")
            await asyncio.sleep(3 * HEAD_TIMEOUT)
        assert not reader.at_eof()
    finally:
        writer.close()
