"""Runs the engine's step loop on its own thread and hands results to asyncio callers.

The model runs on one thread that owns the engine outright; gRPC handlers on the event loop only
put work into an inbox and read their own result queue. So no engine state is ever touched by two
threads, and a slow step never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from inferplane.worker.engine import Engine, StepOutput
from inferplane.worker.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    unfinished: int = 1  # choices still running (n > 1 streams them all on one queue)
    tenant: str = ""  # flow control (fair_share.py): whose share, and which band
    priority: str = ""


class RequestStream:
    """The caller's side of one request: iterate to get StepOutputs until every choice (`index`)
    has sent its finished one."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None], choices: int = 1):
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._unfinished = choices
        self.finished = False

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self._unfinished -= 1
                self.finished = self._unfinished <= 0
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, on_finished: Callable[[StepOutput], None] | None = None):
        self.engine = engine
        self._on_finished = on_finished
        # Guards only the inbox, so submit() never waits for a model step.
        self._wake = threading.Condition(threading.Lock())
        self._submits: list[_Submit] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Submit] = {}
        self._stopped = False
        self.last_stats: dict[str, float] = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._wake:
            return len(self._streams) + len(self._submits)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               cache_salt: str = "", *, tenant: str = "", priority: str = "") -> RequestStream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            self._submits.append(_Submit(request_id, prompt, params, cache_salt, queue, loop, params.n,
                                         tenant=tenant, priority=priority))
            self._wake.notify()
        return RequestStream(request_id, queue, self.abort, params.n)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _deliver(self, sub: _Submit, item) -> None:
        sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)

    def _take_inbox(self) -> tuple[list[_Submit], list[str]]:
        with self._wake:
            while not self._stopped and not self._submits and not self._aborts and not self.engine.has_unfinished():
                self._wake.wait()
            submits, self._submits = self._submits, []
            aborts, self._aborts = self._aborts, []
            return submits, aborts

    def _run(self) -> None:
        while True:
            submits, aborts = self._take_inbox()
            if self._stopped:
                break
            # Only this thread touches the engine.
            for sub in submits:
                try:
                    self.engine.add_request(sub.prompt, sub.params, sub.request_id, sub.cache_salt,
                                            tenant=sub.tenant, priority=sub.priority)
                    self._streams[sub.request_id] = sub
                except ValueError as exc:
                    self._deliver(sub, exc)
            for request_id in aborts:
                sub = self._streams.pop(request_id, None)
                for out in self.engine.abort(request_id):
                    self._finished(out)
                    if sub is not None:
                        self._deliver(sub, out)
            try:
                outputs = self.engine.step() if self.engine.has_unfinished() else []
            except Exception as exc:  # a failed step must fail its requests, not hang them
                log.exception("engine step failed")
                outputs = []
                for request_id, sub in list(self._streams.items()):
                    for out in self.engine.abort(request_id):
                        out.finish_reason = "error"
                        self._finished(out)
                    self._deliver(sub, RuntimeError(f"engine step failed: {exc}"))
                self._streams.clear()
            for out in outputs:
                sub = self._streams.get(out.request_id)
                if out.finished:
                    self._finished(out)
                    if sub is not None:
                        sub.unfinished -= 1
                        if sub.unfinished <= 0:
                            self._streams.pop(out.request_id, None)
                if sub is not None:
                    self._deliver(sub, out)
            self.last_stats = self.engine.stats()  # a snapshot Stats can read without a lock

    def _finished(self, out: StepOutput) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(out)
            except Exception:
                log.exception("on_finished callback failed")
