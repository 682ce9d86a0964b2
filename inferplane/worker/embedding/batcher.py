"""One thread runs every forward; gRPC handlers only queue inputs and await their vectors.

Why a thread and a queue, not a forward per request: a forward holds a CPU (or the GPU) for
milliseconds to seconds, which on the event loop would stall every other call, health checks and
Stats included; and inputs of concurrent requests padded into one forward cost little more than
one request's alone. So `embed` puts a request's inputs at the back of its tenant's queue (sorted
by length within the request, so that neighbours pad little) and the thread forms each forward
within two bounds: `max_inputs` per forward and `max_tokens` padded tokens (inputs × the longest)
per forward, one input always. A request whose caller went away has its queued inputs dropped
unrun.

Tenants take turns, an input each: the tenant whose input went into a forward goes to the back of
the rotation, one whose next input did not fit keeps its turn for the next forward. So one
tenant's request of 2,048 inputs shares every forward with another tenant's single input instead
of running all its forwards first; within a tenant it is first come, first served.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferplane.worker.embedding.encoder import EmbeddingEncoder


@dataclass(eq=False)
class _Request:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    results: list[bytes | None]
    remaining: int
    cancelled: bool = False
    started: bool = False  # an input of it has gone into a forward


@dataclass(eq=False)
class _Input:
    request: _Request
    index: int  # where in the request's inputs (and answer) it belongs
    ids: Sequence[int]


@dataclass
class _Counters:
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0  # spent in forwards


def _resolve(request: _Request, value: list[bytes] | BaseException) -> None:
    """On the request's loop: its answer or its error, unless it was cancelled meanwhile."""
    def settle() -> None:
        if request.future.done():
            return
        if isinstance(value, BaseException):
            request.future.set_exception(value)
        else:
            request.future.set_result(value)

    request.loop.call_soon_threadsafe(settle)


class EmbeddingBatcher:
    def __init__(self, encoder: EmbeddingEncoder, *, max_inputs: int, max_tokens: int,
                 on_finished: Callable[[int, float], None] | None = None) -> None:
        """`on_finished(prompt_tokens, seconds)` runs on the event loop as each request finishes."""
        self.encoder = encoder
        self.max_inputs = max(1, max_inputs)
        self.max_tokens = max(1, max_tokens)
        self._on_finished = on_finished
        self._wake = threading.Condition(threading.Lock())
        self._queues: OrderedDict[str, deque[_Input]] = OrderedDict()  # by tenant, in turn order
        self._requests = 0  # in flight: queued or running
        self._started = 0  # of those, the ones with an input forwarded already
        self._running = 0  # inputs in the forward now
        self._stopped = False
        self.counters = _Counters()
        self._thread = threading.Thread(target=self._run, name="embedding-loop", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._wake:
            return self._requests

    @property
    def last_stats(self) -> dict[str, float]:
        """What Stats reports. The router and the autoscaler count requests (the gateway's in-flight
        figure is requests too), so num_running is the requests with an input forwarded and
        num_waiting those with none yet, and a forward's max_inputs are the slots: as many
        one-input requests share one forward. (A request of many inputs counts once.)"""
        with self._wake:
            requests, started = self._requests, self._started
            queued, forwarding = self._queued(), self._running
        c = self.counters
        return {"num_running": float(started), "num_waiting": float(requests - started),
                "max_num_seqs": float(self.max_inputs), "blocks_total": 0.0, "queued_inputs": float(queued),
                "forward_inputs": float(forwarding), "embedded_requests": float(c.requests),
                "embedded_inputs": float(c.inputs), "prompt_tokens": float(c.tokens),
                "padded_tokens": float(c.padded_tokens), "forwards": float(c.forwards),
                "forward_seconds": c.seconds}

    async def embed(self, inputs: Sequence[Sequence[int]], tenant: str = "") -> list[bytes]:
        """Each input's vector as float32 little-endian bytes, in order. ValueError (naming
        `input`) for inputs the model cannot take, before anything is queued. `tenant`: whose turn
        the inputs take (module docstring)."""
        if not inputs:
            raise ValueError("input: at least one input is required")
        self.encoder.check(inputs)
        loop = asyncio.get_running_loop()
        request = _Request(loop.create_future(), loop, [None] * len(inputs), len(inputs))
        start = time.perf_counter()
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        with self._wake:
            if self._stopped:
                raise RuntimeError("the embedding runtime has stopped")
            self._requests += 1
            self._queues.setdefault(tenant, deque()).extend(_Input(request, i, inputs[i]) for i in order)
            self._wake.notify()
        try:
            vectors = await request.future
        except BaseException:
            request.cancelled = True  # the thread skips what is still queued
            raise
        finally:
            with self._wake:
                self._requests -= 1
                self._started -= request.started
        if self._on_finished is not None:
            self._on_finished(sum(len(ids) for ids in inputs), time.perf_counter() - start)
        return vectors

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _queued(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def _take(self) -> list[_Input]:
        """The next forward's inputs (caller holds the lock): live inputs, the tenants in turn, within
        max_inputs and max_tokens padded tokens; the first always."""
        batch: list[_Input] = []
        longest = 0
        while self._queues and len(batch) < self.max_inputs:
            tenant, queue = next(iter(self._queues.items()))
            item = queue[0]
            if item.request.cancelled:
                queue.popleft()
                if not queue:
                    del self._queues[tenant]
                continue
            wider = max(longest, len(item.ids))
            if batch and wider * (len(batch) + 1) > self.max_tokens:
                break  # this tenant's input starts the next forward
            batch.append(queue.popleft())
            if queue:
                self._queues.move_to_end(tenant)
            else:
                del self._queues[tenant]
            longest = wider
            if not item.request.started:
                item.request.started = True
                self._started += 1
        return batch

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queues and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    leftover = {item.request for queue in self._queues.values() for item in queue}
                    self._queues.clear()
                    for request in leftover:
                        _resolve(request, RuntimeError("the embedding runtime stopped before this request ran"))
                    return
                batch = self._take()
                self._running = len(batch)
            if batch:
                self._forward(batch)
            with self._wake:
                self._running = 0

    def _forward(self, batch: list[_Input]) -> None:
        start = time.perf_counter()
        try:
            vectors = self.encoder.embed([item.ids for item in batch]).numpy()
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets it, the loop goes on
            failed = {item.request for item in batch}
            for request in failed:
                request.cancelled = True
                _resolve(request, exc if isinstance(exc, ValueError) else RuntimeError(f"embedding failed: {exc}"))
            return
        c = self.counters
        c.forwards += 1
        c.seconds += time.perf_counter() - start
        c.padded_tokens += vectors.shape[0] * max(len(item.ids) for item in batch)
        little_endian = vectors.astype("<f4", copy=False)
        for row, item in enumerate(batch):
            request = item.request
            request.results[item.index] = little_endian[row].tobytes()
            request.remaining -= 1
            c.inputs += 1
            c.tokens += len(item.ids)
            if request.remaining == 0:
                c.requests += 1
                _resolve(request, request.results)  # type: ignore[arg-type]
