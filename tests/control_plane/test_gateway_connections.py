"""The gateway's HTTP server keeps an idle keep-alive connection open past the clients' own expiry.

httpx (and so the openai client) keeps an idle connection for 5 s and reuses it until then. With
uvicorn's default keep-alive of 5 s the server closed such a connection just as a client sent its
next request on it, and the request was dropped (httpx.ReadError: seen in the autoscaling test's
trickle under load). A real server on a real socket: the second request of one connection, sent
after an idle pause longer than 5 s, gets its answer.
"""

from __future__ import annotations

import asyncio

from inferplane.bench.gateway_harness import free_port
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

IDLE_PAUSE = 6.5  # past the 5 s that both httpx's expiry and uvicorn's default keep-alive are


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One GET /healthz on the open connection; the status line of its answer (b"" if it was closed)."""
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 60)
    headers = {}
    while (line := await asyncio.wait_for(reader.readline(), 60)) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 60)
    return status


async def test_an_idle_connection_outlives_the_clients_expiry(tmp_path):
    port = free_port()
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=port))
    assert gateway.settings.keep_alive_seconds > IDLE_PAUSE
    await gateway.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert (await _get(reader, writer)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(IDLE_PAUSE)
            assert not reader.at_eof(), "the server closed the idle connection"
            assert (await _get(reader, writer)).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
    finally:
        await gateway.stop()
