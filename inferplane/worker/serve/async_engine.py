"""Runs the engine's step loop on its own thread and hands results to asyncio callers.

The model runs on one thread that owns the engine outright; gRPC handlers on the event loop only
put work into an inbox and read their own result queue. So no engine state is ever touched by two
threads, and a slow step never blocks the event loop.

Two things a request may need are done first, on a small pool of their own, and only then is it
put into the inbox, so that neither stalls the engine's steps and a request waiting on them holds
no batch slot: a structured-output request's grammar is compiled (`GrammarLimits.compile_threads`
threads; llguidance drops the GIL while it compiles), and, where the engine has KV tiers, the
prompt's KV blocks held on disk are read into memory (`Engine.prefetch_kv`). Such a request counts
in `num_in_flight` all along (the autoscaler and the drain read it) and can be aborted; an aborted
request's grammar, once compiled, is only cached, and its prefetched blocks stay in the tier.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from inferplane.worker.engine.engine import Engine
from inferplane.worker.engine.outputs import StepOutput
from inferplane.worker.engine.sampling import SamplingParams

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
    adapter: Any = None  # lora.LoraAdapter, read off this thread and the engine's
    resume: list[int] | None = None  # output tokens an earlier replica delivered (Engine.add_request)
    choice_index: int = 0  # which choice of an earlier request (n > 1) this one continues


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
        self._preparing: dict[str, _Submit] = {}  # on the prepare pool (grammar, KV read ahead), not yet in the inbox
        self._prepare_pool: ThreadPoolExecutor | None = None  # made on the first request that needs it
        self._stopped = False
        self.last_stats: dict[str, float] = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._wake:
            return len(self._streams) + len(self._submits) + len(self._preparing)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               cache_salt: str = "", *, tenant: str = "", priority: str = "", adapter=None,
               resume: list[int] | None = None, choice_index: int = 0) -> RequestStream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sub = _Submit(request_id, prompt, params, cache_salt, queue, loop, params.n, tenant=tenant, priority=priority,
                      adapter=adapter, resume=resume, choice_index=choice_index)
        stream = RequestStream(request_id, queue, self.abort, params.n)
        compile_grammar = False
        if params.constraint is not None:
            try:
                compile_grammar = not self._cached(params.constraint)
            except ValueError as exc:  # a refusal the cache remembers
                self._deliver(sub, exc)
                return stream
        if compile_grammar or self._reads_kv_ahead(prompt):
            self._prepare_first(sub, compile_grammar)
            return stream
        with self._wake:
            self._submits.append(sub)
            self._wake.notify()
        return stream

    def _reads_kv_ahead(self, prompt: str | list[int]) -> bool:
        """Whether the engine keeps a disk tier a prompt of token ids could find blocks in (a memory
        tier alone is read on the engine's thread: there is nothing to wait for)."""
        tiers = self.engine.kv.tiers
        return tiers is not None and tiers.store.disk is not None and not isinstance(prompt, str) \
            and len(prompt) > self.engine.block_size

    def _prepare_first(self, sub: _Submit, compile_grammar: bool) -> None:
        with self._wake:
            if sub.request_id in self._preparing:
                self._deliver(sub, ValueError(f"request_id: {sub.request_id!r} is already running"))
                return
            self._preparing[sub.request_id] = sub
            if self._prepare_pool is None:
                from inferplane.worker.structured import LIMITS

                self._prepare_pool = ThreadPoolExecutor(LIMITS.compile_threads, thread_name_prefix="request-prepare")
            self._prepare_pool.submit(self._prepare, sub, compile_grammar)

    def _cached(self, constraint) -> bool:
        """Whether the grammar is compiled already (then attached to the constraint, so the engine
        thread only copies it); GrammarError if the cache holds its refusal. False: compile first."""
        compiler = self.engine.intake.grammars
        return compiler is not None and compiler.prepare_cached(constraint)

    def _prepare(self, sub: _Submit, compile_grammar: bool) -> None:
        """On the prepare pool: compiles the grammar and reads the prompt's KV ahead, then hands the
        request to the engine unless it was aborted meanwhile (the grammar stays cached either way)."""
        with self._wake:
            if self._preparing.get(sub.request_id) is not sub:
                return  # aborted while it waited for a thread: nothing to do
        error: BaseException | None = None
        try:
            if compile_grammar:
                self.engine.intake.grammar_compiler().prepare(sub.params.constraint)
        except ValueError as exc:  # GrammarError: a 400 naming the field
            error = exc
        except Exception as exc:  # never leave the request hanging
            log.exception("compiling a structured-output grammar failed")
            error = RuntimeError(f"compiling the structured-output grammar failed: {type(exc).__name__}")
        if error is None:
            try:
                # A resumed request's delivered tokens are its history too: their blocks are read ahead.
                history = sub.prompt + sub.resume if sub.resume and isinstance(sub.prompt, list) else sub.prompt
                self.engine.prefetch_kv(history, sub.cache_salt, sub.adapter)
            except Exception:  # a read ahead that fails costs time only: the engine computes the prefix
                log.exception("reading a prompt's KV ahead failed")
        with self._wake:
            if self._preparing.get(sub.request_id) is not sub:
                return  # aborted while preparing
            del self._preparing[sub.request_id]
            if error is None:
                self._submits.append(sub)
                self._wake.notify()
        if error is not None:
            self._deliver(sub, error)

    def abort(self, request_id: str) -> None:
        with self._wake:
            sub = self._preparing.pop(request_id, None)
            if sub is None:
                self._aborts.append(request_id)
                self._wake.notify()
                return
        # Still preparing: the engine never saw it. Its compile finishes into the cache only.
        for index in range(sub.params.n):
            out = StepOutput(request_id, [], [], "", True, "abort", index=index)
            self._finished(out)
            self._deliver(sub, out)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
            preparing, self._preparing = list(self._preparing.values()), {}
        for sub in preparing:
            self._deliver(sub, RuntimeError("the engine stopped"))
        if self._prepare_pool is not None:
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
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
        # Entered once for every step this thread runs: ModelRunner.execute then skips its own entry.
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while True:
            submits, aborts = self._take_inbox()
            if self._stopped:
                break
            # Only this thread touches the engine.
            for sub in submits:
                try:
                    self.engine.add_request(sub.prompt, sub.params, sub.request_id, sub.cache_salt,
                                            tenant=sub.tenant, priority=sub.priority, adapter=sub.adapter,
                                            resume=sub.resume, choice_index=sub.choice_index)
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
                if out.error is not None:  # the request failed (its grammar gave up): fail the stream
                    self._failed(out, sub)
                    continue
                if out.finished:
                    self._finished(out)
                    if sub is not None:
                        sub.unfinished -= 1
                        if sub.unfinished <= 0:
                            self._streams.pop(out.request_id, None)
                if sub is not None:
                    self._deliver(sub, out)
            self.last_stats = self.engine.stats()  # a snapshot Stats can read without a lock

    def _failed(self, out: StepOutput, sub: _Submit | None) -> None:
        """One choice ended in error: the request fails (its other choices are aborted) and its
        stream raises the error (a ValueError naming the field: the worker's INVALID_ARGUMENT)."""
        from inferplane.worker.structured import GrammarError

        self._finished(out)
        self._streams.pop(out.request_id, None)
        for other in self.engine.abort(out.request_id):
            self._finished(other)
        if sub is not None:
            self._deliver(sub, GrammarError(out.error))

    def _finished(self, out: StepOutput) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(out)
            except Exception:
                log.exception("on_finished callback failed")
