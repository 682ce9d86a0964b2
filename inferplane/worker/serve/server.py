"""The worker's gRPC server: `inferplane.v1.Worker`, standard health, reflection, graceful drain.

Lifecycle: the server starts at once and answers health NOT_SERVING while the model loads (so a
Kubernetes startup probe can wait for it), turns SERVING when the engine is ready, and on SIGTERM
turns NOT_SERVING again, refuses new work, lets in-flight requests finish within the grace period
and exits 0.

A worker serves one model of one kind (api/architectures.py): a generative model's engine answers
Generate, an embedding model's batcher (runtime embedding) answers Embed; each refuses the other
RPC with FAILED_PRECONDITION naming the model's kind, which the gateway turns into a 400.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from inferplane.api.lora_manifest import AdapterError
from inferplane.v1 import worker_pb2, worker_pb2_grpc
from inferplane.worker.embedding.batcher import EmbeddingBatcher
from inferplane.worker.engine.outputs import StepOutput
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.serve.async_engine import AsyncEngine
from inferplane.worker.serve.kv_event_stream import kv_event_stream
from inferplane.worker.serve.kv_transfer import KVTransfer

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def params_from_proto(p: worker_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a Generate call's, converted and not checked: the engine
    checks them once, with the prompt (`SamplingParams.validate`, from `Engine.add_request`), for
    whoever called (the gateway, which checked the ranges and settled max_tokens already; a
    benchmark or any other gRPC client, which did not). Proto3 has no 'unset' for scalars: 0
    max_tokens means up to the context (None), 0 top_p, repetition_penalty or n mean 1."""
    return SamplingParams(
        max_tokens=p.max_tokens or None,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=max(p.top_k, 0),
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        constraint=_constraint(p.constraint_kind, p.constraint_spec) if p.constraint_kind else None,
        n=p.n or 1,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def _constraint(kind: str, spec: str):
    """The proto's constraint as a `structured.Constraint` (GrammarError, a ValueError, if malformed)."""
    import json

    from inferplane.worker.structured import Constraint, GrammarError

    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError as exc:
            raise GrammarError(f"structured_outputs: choice is not a JSON list of strings: {exc}") from None
        return Constraint(kind, choices)  # its own GrammarError (a bound, a non-string) names the field
    return Constraint(kind, spec or None)


def _response(out: StepOutput) -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(text=out.text_delta, token_ids=out.new_token_ids,
                                      logprobs=out.new_logprobs, finished=out.finished,
                                      finish_reason=out.finish_reason or "", index=out.index,
                                      stop_string=out.stop_string or "")
    for alternatives in out.new_top_logprobs:
        msg.top_logprobs.add(token_ids=[t for t, _ in alternatives], logprobs=[lp for _, lp in alternatives])
    for scored in out.prompt_logprobs or ():
        msg.prompt_logprobs.append(scored.logprob)
        msg.prompt_top_logprobs.add(token_ids=[t for t, _ in scored.top], logprobs=[lp for _, lp in scored.top])
    if out.finished:
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        msg.usage.cached_tokens = out.num_cached_tokens
    return msg


@dataclass
class WorkerState:
    model: str
    runtime: str
    engine: AsyncEngine | None = None  # a generative model's
    embedder: EmbeddingBatcher | None = None  # an embedding model's (runtime embedding)
    draining: bool = False
    info: dict = field(default_factory=dict)
    extra_stats: dict[str, float] = field(default_factory=dict)
    adapter_source: Any = None  # lora.AdapterSource, made on the first request for an adapter
    transfer: KVTransfer | None = None  # with KV tiers: pulls a prompt's KV from, and serves it to, other workers

    def live_stats(self) -> dict[str, float]:
        """Figures kept outside the engine's snapshot, read at scrape time: the KV transfer's."""
        return self.transfer.stats() if self.transfer is not None else {}

    @property
    def runner(self) -> AsyncEngine | EmbeddingBatcher | None:
        """Whichever serves the model: what Stats, Info and the drain read (num_in_flight, last_stats)."""
        return self.engine if self.engine is not None else self.embedder


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, state: WorkerState):
        self.state = state

    async def _runner(self, context) -> AsyncEngine | EmbeddingBatcher:
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining; retry on another replica")
        if self.state.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
        return self.state.runner

    async def _engine(self, context) -> AsyncEngine:
        runner = await self._runner(context)
        if not isinstance(runner, AsyncEngine):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model: {self.state.model} is an embedding model; it answers Embed "
                                "(/v1/embeddings), not Generate")
        return runner

    def _prompt(self, request: worker_pb2.GenerateRequest):
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return request.text
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            tokenizer = self.state.engine.engine.tokenizer
            if tokenizer is None:
                raise ValueError("chat: this model has no tokenizer")
            if not request.chat.messages:
                raise ValueError("chat: messages must not be empty")
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        raise ValueError("prompt: one of text, token_ids or chat is required")

    def _adapter_source(self):
        """Where this replica's adapters come from (lora.AdapterSource); a ValueError where it serves none."""
        if self.state.adapter_source is None:
            engine = self.state.engine.engine
            if engine.adapters is None:
                raise ValueError("model: this replica serves no LoRA adapters (max_loras is 0)")
            from inferplane.worker.lora.catalog import AdapterCatalog
            from inferplane.worker.lora.sources import AdapterSource

            self.state.adapter_source = AdapterSource(AdapterCatalog.for_engine(engine))
        return self.state.adapter_source

    async def _adapter(self, request: worker_pb2.GenerateRequest):
        """The request's adapter, fetched and read on a worker thread (None: the base). A refusal
        names the request's `model` field first (it named the adapter): the gateway's 400 param."""
        if not request.HasField("adapter"):
            return None
        ref = request.adapter
        try:
            return await asyncio.to_thread(self._adapter_source().adapter, ref.name, ref.uri, ref.sha256)
        except AdapterError as exc:
            raise ValueError(f"model: {exc}") from None

    async def Generate(self, request, context):
        engine = await self._engine(context)
        try:
            prompt = self._prompt(request)
            params = params_from_proto(request.params)
            adapter = await self._adapter(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.kv_source and self.state.transfer is not None and isinstance(prompt, list):
            # Disaggregated: the prompt's KV was computed by the prefill worker named; what arrives is
            # found by the prefix match like any tier hit, the rest is computed here.
            history = prompt + list(request.resumed_token_ids)
            await self.state.transfer.pull(request.kv_source,
                                           engine.engine.kv_keys(history, request.cache_salt, adapter))
        stream = engine.submit(request.request_id or uuid.uuid4().hex, prompt, params, request.cache_salt,
                               tenant=request.tenant, priority=request.priority, adapter=adapter,
                               resume=list(request.resumed_token_ids) or None, choice_index=request.choice_index)
        try:
            async for out in stream:
                yield _response(out)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            stream.abort()  # a cancelled or timed-out stream frees its sequence's blocks at once

    async def Embed(self, request, context):
        runner = await self._runner(context)
        if not isinstance(runner, EmbeddingBatcher):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model: {self.state.model} is a generative model; it answers Generate "
                                "(chat and completions), not Embed")
        inputs = [list(i.ids) for i in request.inputs]
        try:
            vectors = await runner.embed(inputs, tenant=request.tenant)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        usage = worker_pb2.Usage(prompt_tokens=sum(len(ids) for ids in inputs))
        return worker_pb2.EmbedResponse(embeddings=vectors, dimensions=runner.encoder.dimensions, usage=usage)

    async def Stats(self, request, context):
        runner = await self._runner(context)
        values = {k: float(v) for k, v in runner.last_stats.items()}
        values.update(self.state.extra_stats)
        values.update(self.state.live_stats())
        values["num_in_flight"] = float(runner.num_in_flight)
        return worker_pb2.StatsResponse(model=self.state.model, runtime=self.state.runtime, values=values)

    async def KVEvents(self, request, context):
        engine = await self._engine(context)
        log = engine.engine.kv.events
        if log is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker publishes no KV events (engine.kvEvents is off, or its KV manager "
                                "is paged)")
        async for batch in kv_event_stream(log):
            yield batch

    async def FetchKV(self, request, context):
        # Served while draining too: a decode worker pulls what this worker prefilled just before.
        transfer = self.state.transfer
        if transfer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker keeps no KV tiers to serve blocks from (engine.kvOffloadMemory)")
        refusal = transfer.check_layout(request.layout_fingerprint)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        async for message in transfer.serve(list(request.keys)):
            yield message

    async def Info(self, request, context):
        await self._runner(context)
        return worker_pb2.InfoResponse(**self.state.info)


class WorkerServer:
    """Owns the grpc.aio server, the health servicer and the drain sequence."""

    def __init__(self, state: WorkerState, host: str, port: int):
        self.state = state
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(state), self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.stop_requested = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting, let in-flight requests finish (up to the grace period), then stop."""
        self.state.draining = True
        await self.set_serving(False)
        deadline = time.monotonic() + grace_seconds
        runner = self.state.runner
        while runner is not None and runner.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if runner is not None and runner.num_in_flight:
            log.warning("drain grace period over with %d requests in flight", runner.num_in_flight)
        await self.server.stop(grace=1.0)
        if self.state.transfer is not None:
            await self.state.transfer.close()
        if runner is not None:
            runner.stop()


def print_line(text: str) -> None:
    print(text, flush=True)
    sys.stdout.flush()
