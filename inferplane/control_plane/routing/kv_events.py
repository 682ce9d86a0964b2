"""Follows the `KVEvents` stream of every replica whose deployment routes kv-aware, into the index.

One task per replica address: it opens the stream, applies each batch (the first a snapshot), and
when the stream ends (the worker stopped, restarted or was deleted) forgets the replica's entries and
opens it again after a pause, so what the index says of a replica is never older than its stream.
Addresses come and go with the routes (a rollout, scaling); the set is re-read every `interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import grpc

from inferplane.control_plane.routing.kv_index import KVIndex
from inferplane.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# A worker that publishes no events (FAILED_PRECONDITION) is asked again this much later: a
# deployment whose spec changed may run ones that do.
UNPUBLISHED_RETRY_S = 30.0


class KVEventSubscriber:
    def __init__(self, index: KVIndex, addresses: Callable[[], Iterable[str]],
                 stub: Callable[[str], worker_pb2_grpc.WorkerStub], *, retry_s: float = 1.0) -> None:
        self.index = index
        self._addresses = addresses
        self._stub = stub
        self.retry_s = retry_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.batches = 0  # applied, for the gateway's metrics

    def sync(self) -> None:
        """Starts following new addresses and stops following (and forgets) departed ones."""
        wanted = set(self._addresses())
        for address in set(self._tasks) - wanted:
            self._tasks.pop(address).cancel()
            self.index.drop(address)
        for address in wanted - set(self._tasks):
            self._tasks[address] = asyncio.create_task(self._follow(address), name=f"kv-events {address}")

    async def _follow(self, address: str) -> None:
        while True:
            pause = self.retry_s
            try:
                stream = self._stub(address).KVEvents(worker_pb2.KVEventsRequest())
                async for batch in stream:
                    self.index.apply(address, batch)
                    self.batches += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    pause = UNPUBLISHED_RETRY_S
                else:
                    log.debug("KV events of %s: stream ended (%s)", address, exc.code())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV events of %s: stream failed", address)
            self.index.drop(address)
            await asyncio.sleep(pause)

    async def run(self, interval_s: float = 1.0) -> None:
        """Keeps the followed set equal to the addresses, forever; cancel the task to stop."""
        try:
            while True:
                try:
                    self.sync()
                    self.index.expire()
                except Exception:
                    log.exception("KV event subscription round failed")
                await asyncio.sleep(interval_s)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, {}
        for task in tasks.values():
            task.cancel()
        for task in tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
