"""A TCP forwarder from the host's loopback into the node's network namespace.

The node (kubelet, containerd, the control plane, pods) lives in a network namespace of its own,
with 10.x addresses that must never appear outside it. Tests, kubectl and helm on the host still
need the API server and Services. The parent makes the listening socket on the host's loopback and
hands it to this process, which runs inside the namespace (`nsenter --net=...`): accepted
connections come from the host, the connections it opens go to addresses inside the namespace.

    python -m tests.cluster.forward --fd N --to HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listener: socket.socket, host: str, port: int) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, target_writer), _pipe(target_reader, client_writer))

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="an inherited listening socket")
    parser.add_argument("--to", required=True, help="HOST:PORT inside this network namespace")
    args = parser.parse_args()
    host, _, port = args.to.rpartition(":")
    listener = socket.socket(fileno=args.fd)
    listener.setblocking(False)
    asyncio.run(_serve(listener, host, int(port)))


if __name__ == "__main__":
    main()
