"""A prompt's KV moved between workers: prefill/decode disaggregation's transfer.

The prefill worker keeps what it computed in its KV tiers (every full block is saved there as it
joins the radix tree, kv/radix.py), so serving a pull is reading records out of them (`serve`,
FetchKV). The decode worker asks for the blocks of its request's prompt that it lacks, from the
worker the gateway named (`GenerateRequest.kv_source`), and stores each record in its own tiers
after record.py's checks (layout fingerprint, key, length, checksum); its prefix match then reads
them into the pool as it reads any tier hit (`RadixKV._load_from_tiers`). So a block is moved under
the same name, format and checks as it is kept, and a pull that fails or stops short only leaves
more of the prompt to compute: never wrong KV.

Why a pull by the decode side and not a push: the decode worker knows what it already holds (the
conversation's earlier turns, from kv-aware routing), so it asks only for the rest; and vLLM's
`kv_transfer_params` work the same way (the prefill side keeps the blocks, the decode side reads).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import grpc

from inferplane.v1 import worker_pb2, worker_pb2_grpc
from inferplane.worker.engine.kv.tiers.record import Part
from inferplane.worker.engine.kv.tiers.store import TieredKVStore

log = logging.getLogger(__name__)

# Records per FetchKV message, by bytes: under gRPC's message limit on both sides (CHANNEL_OPTIONS).
MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
# A pull that takes longer than this is abandoned (the prompt is computed instead).
PULL_TIMEOUT_S = 60.0
MAX_CHANNELS = 32  # open channels to prefill workers kept at once


class KVTransfer:
    """One worker's two sides of the transfer, with its counters (the worker's metrics)."""

    def __init__(self, store: TieredKVStore):
        self.store = store
        self.blocks: Counter[str] = Counter()  # by direction: pulled, served
        self.bytes: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.failures = 0  # pulls that failed (the source gone, a refusal): the prompt computed here
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pulling: dict[bytes, asyncio.Future] = {}  # pulls under way, by their first key
        self._closing: set[asyncio.Task] = set()  # channels being closed

    # -- serving (the prefill side) ---------------------------------------------------------------

    def check_layout(self, fingerprint: bytes) -> str | None:
        """Why a pull for `fingerprint` cannot be served (another model, KV dtype or block size), or None."""
        if fingerprint != self.store.layout.fingerprint():
            return "layout_fingerprint: this worker's KV has another layout (model, KV dtype, block size)"
        return None

    async def serve(self, keys: Sequence[bytes]) -> AsyncIterator[worker_pb2.KVRecords]:
        """The records of `keys`, in order, as far as the tiers hold their main parts in a row, each
        with its window part where one is held; in messages of about MESSAGE_BYTES. Read on a
        thread: a disk tier's files must not hold the event loop."""
        started = time.perf_counter()
        batch: list[worker_pb2.KVRecord] = []
        size = 0
        for key in keys:
            main, window = await asyncio.to_thread(self._records, key)
            if main is None:
                break
            batch.append(worker_pb2.KVRecord(key=key, record=main))
            if window is not None:
                batch.append(worker_pb2.KVRecord(key=key, window=True, record=window))
            size += len(main) + (len(window) if window is not None else 0)
            self.blocks["served"] += 1
            if size >= MESSAGE_BYTES:
                yield worker_pb2.KVRecords(records=batch)
                self.bytes["served"] += size
                batch, size = [], 0
        if batch:
            yield worker_pb2.KVRecords(records=batch)
            self.bytes["served"] += size
        self.seconds["served"] += time.perf_counter() - started

    def _records(self, key: bytes) -> tuple[bytes | None, bytes | None]:
        main = self.store.record_of(key)
        if main is None or not self.store.layout.window_layers:
            return main, None
        return main, self.store.record_of(key, Part.WINDOW)

    # -- pulling (the decode side) ----------------------------------------------------------------

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys to pull: from the first block no tier here holds, as many as the memory tier can
        take without evicting the first of them before the prefix match reads it (a pull past that
        would only push its own start out)."""
        start = 0
        while start < len(keys) and self.store.where(keys[start]) is not None:
            start += 1
        wanted = list(keys[start:])
        memory = self.store.memory
        if memory is not None:
            per_block = self.store.record_bytes() + (self.store.record_bytes(Part.WINDOW)
                                                     if self.store.layout.window_layers else 0)
            wanted = wanted[:max(0, memory.capacity // per_block - 1)]
        return wanted

    async def pull(self, source: str, keys: Sequence[bytes]) -> int:
        """Pulls from worker `source` ("host:port") the blocks of `keys` this worker's tiers lack;
        returns the blocks stored. A failure is logged and counted, never raised: the engine then
        computes what did not arrive. Only records of the keys asked for, in their order, are kept."""
        stored = 0
        while True:
            wanted = await asyncio.to_thread(self.missing, keys)
            if not wanted:
                return stored
            running = self._pulling.get(wanted[0])
            if running is None:
                break
            # The same blocks are being pulled for another request (n > 1 choices, or prompts that
            # share a start): wait for that pull, then take what it left.
            await asyncio.shield(running)
        done = self._pulling[wanted[0]] = asyncio.get_running_loop().create_future()
        try:
            return stored + await self._pull(source, wanted)
        finally:
            del self._pulling[wanted[0]]
            done.set_result(None)

    async def _pull(self, source: str, wanted: list[bytes]) -> int:
        started = time.perf_counter()
        stored = 0
        request = worker_pb2.FetchKVRequest(layout_fingerprint=self.store.layout.fingerprint(), keys=wanted)
        call = None
        try:
            call = worker_pb2_grpc.WorkerStub(self._channel(source)).FetchKV(request, timeout=PULL_TIMEOUT_S)
            expected = iter(wanted)
            async for message in call:
                accepted, size, intact = await asyncio.to_thread(self._store, message.records, expected)
                stored += accepted
                self.bytes["pulled"] += size
                if not intact:
                    break  # a record failed its checks or came out of order: the prefix ends there
        except Exception as exc:  # the source gone, refusing, or anything else: the prompt is computed here
            self.failures += 1
            log.warning("pulling KV from %s failed after %d blocks: %s", source, stored, exc)
        finally:
            if call is not None:
                call.cancel()  # a no-op once it ended; stops the sender where this side stopped reading
        self.blocks["pulled"] += stored
        self.seconds["pulled"] += time.perf_counter() - started
        return stored

    def _store(self, records: Sequence[worker_pb2.KVRecord], expected) -> tuple[int, int, bool]:
        """Stores one message's records, each checked against the key asked for next (a main part
        names the next key; its window part follows it) and by record.py; returns (main parts
        stored, bytes received, whether every record passed)."""
        stored = size = 0
        key = None
        for item in records:
            size += len(item.record)
            if not item.window:
                key = next(expected, None)
            if item.key != key:
                return stored, size, False
            if not self.store.put_record(item.key, item.record, Part.WINDOW if item.window else Part.MAIN):
                return stored, size, False
            stored += not item.window
        return stored, size, True

    def _channel(self, source: str) -> grpc.aio.Channel:
        channel = self._channels.pop(source, None)
        if channel is None:
            channel = grpc.aio.insecure_channel(source, options=CHANNEL_OPTIONS)
            while len(self._channels) >= MAX_CHANNELS:  # prefill pods come and go: the oldest goes
                oldest = next(iter(self._channels))
                closing = asyncio.get_running_loop().create_task(self._channels.pop(oldest).close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
        self._channels[source] = channel  # the most recently used last
        return channel

    def stats(self) -> dict[str, float]:
        """The worker's transfer figures, labelled by direction (serve/metrics.py)."""
        out: dict[str, float] = {"kv_transfer_failures_total": float(self.failures)}
        for direction in ("pulled", "served"):
            out[f"kv_transfer_blocks_total:{direction}"] = float(self.blocks[direction])
            out[f"kv_transfer_bytes_total:{direction}"] = float(self.bytes[direction])
            out[f"kv_transfer_seconds_total:{direction}"] = self.seconds[direction]
        return out

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
