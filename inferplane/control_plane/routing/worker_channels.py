"""gRPC channels to workers, one per address, reused across requests (HTTP/2 multiplexes): the
gateway streams requests over them and the autoscaler polls load through them.

Pods come and go (rollouts, autoscaling); a channel to an address no route names any more is
closed once it has been gone for a grace period, so that a long-running gateway does not keep a
connection (and its reconnect attempts) per pod it ever saw. The grace period is the request
timeout: a pod leaving its EndpointSlice is draining, and the requests still streaming from it
must be able to finish.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import grpc

from inferplane.v1 import worker_pb2_grpc


class WorkerChannels:
    def __init__(self) -> None:
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._missing_since: dict[str, float] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    @property
    def addresses(self) -> set[str]:
        return set(self._channels)

    async def prune(self, live: Collection[str], grace: float, now: float | None = None) -> list[str]:
        """Closes the channels of addresses missing from `live` for at least `grace` seconds;
        returns the addresses closed."""
        now = time.monotonic() if now is None else now
        closed = []
        for address in list(self._channels):
            if address in live:
                self._missing_since.pop(address, None)
                continue
            since = self._missing_since.setdefault(address, now)
            if now - since >= grace:
                await self._close(address)
                closed.append(address)
        return closed

    async def _close(self, address: str) -> None:
        self._stubs.pop(address, None)
        self._missing_since.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self._close(address)
