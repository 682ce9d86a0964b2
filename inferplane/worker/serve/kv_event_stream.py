"""The `KVEvents` stream: a worker's KV event log (engine/kv/events.py) as gRPC messages.

Each subscriber (a gateway replica) gets a snapshot first, then every change as it is published; one
that falls further behind than the log keeps gets a new snapshot. That is what lets every gateway
replica keep its own index without shared state, and a restarted gateway converge as soon as its
streams open. A gRPC server stream was chosen over ZMQ PUB/SUB (vLLM's transport): the gateway
already holds a channel to each worker, a stream has flow control and tells both sides when the
other goes away, and a snapshot on (re)connect needs no second socket or replay buffer protocol.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable

from inferplane.v1 import worker_pb2
from inferplane.worker.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog

# Hashes (or events) per message, so that a large snapshot stays far below gRPC's 4 MiB default.
CHUNK = 8192

# This process, told apart from a worker restarted at the same address.
INSTANCE_ID = uuid.uuid4().hex


def event_message(event: KVEvent, block_size: int) -> worker_pb2.KVEvent:
    """One event in the wire's fields."""
    if isinstance(event, BlockStored):
        return worker_pb2.KVEvent(stored=worker_pb2.KVBlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash or b"",
            token_ids=event.token_ids, block_size=block_size, lora_name=event.lora_name, medium=event.medium))
    if isinstance(event, BlockRemoved):
        return worker_pb2.KVEvent(removed=worker_pb2.KVBlockRemoved(block_hashes=event.block_hashes,
                                                                     medium=event.medium))
    if isinstance(event, AllBlocksCleared):
        return worker_pb2.KVEvent(all_cleared=worker_pb2.KVAllBlocksCleared(medium=event.medium or ""))
    raise TypeError(f"not a KV event: {event!r}")


def snapshot_batches(log: KVEventLog) -> tuple[int, list[worker_pb2.KVEventBatch]]:
    """The log's state as batches: the first (snapshot=true) clears, the rest store each medium's
    blocks; and the position the events after it continue from."""
    position, held = log.snapshot()
    events: list[worker_pb2.KVEvent] = [event_message(AllBlocksCleared(), log.block_size)]
    for medium, hashes in held.items():
        for start in range(0, len(hashes), CHUNK):
            events.append(event_message(BlockStored(tuple(hashes[start:start + CHUNK]), medium), log.block_size))
    now = time.time()
    batches = [worker_pb2.KVEventBatch(ts=now, sequence=position, snapshot=i == 0, instance_id=INSTANCE_ID,
                                       events=[event])
               for i, event in enumerate(events)]
    return position, batches


def _batches(events: Iterable[KVEvent], position: int, block_size: int) -> list[worker_pb2.KVEventBatch]:
    messages = [event_message(event, block_size) for event in events]
    now = time.time()
    return [worker_pb2.KVEventBatch(ts=now, sequence=position, instance_id=INSTANCE_ID,
                                    events=messages[start:start + CHUNK])
            for start in range(0, len(messages), CHUNK)]


async def kv_event_stream(log: KVEventLog) -> AsyncIterator[worker_pb2.KVEventBatch]:
    """A subscriber's messages until it goes away."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    flagged = threading.Event()  # a wake-up is on its way: publishers schedule at most one

    def listener() -> None:
        if flagged.is_set():
            return
        flagged.set()
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop closed: the stream is over anyway
            pass

    log.add_listener(listener)
    try:
        position, batches = snapshot_batches(log)
        for batch in batches:
            yield batch
        while True:
            await wake.wait()
            wake.clear()
            flagged.clear()
            got = log.since(position)
            if got is None:  # fell behind what the log keeps: start over from the state
                position, batches = snapshot_batches(log)
            else:
                position, events = got
                batches = _batches(events, position, log.block_size)
            for batch in batches:
                yield batch
    finally:
        log.remove_listener(listener)
