"""gRPC channels to workers, one per address, reused across requests (HTTP/2 multiplexes)."""

from __future__ import annotations

import grpc

from inferplane.v1 import worker_pb2_grpc


class WorkerChannels:
    def __init__(self) -> None:
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
