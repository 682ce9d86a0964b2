"""The request path shared by the REST and gRPC tenant APIs.

authenticate (done by the caller) → authorize the model → charge the request to the key's
requests-per-minute and look at the tenant's quota (429), before any work on the prompt → render
the chat template and tokenize, on a thread for a large prompt (a prompt with more bytes than the
context can hold tokens of is refused without tokenizing, see prompt_bound.py) and check the
context length (400) → hold its sequences against the key's and tenant's concurrency limits →
reserve the request's worst case (prompt + max_tokens) against the tenant's quota and the key's
token limit → route to a replica (prefix affinity, load, retry before the first token) → stream,
telling the worker the tenant and priority band it schedules by → record usage off the request
path, refund what the reservation did not use and give the sequences back.

Why the request is charged first: tokenizing a megabyte prompt takes seconds of CPU, so a key
limited to 5 requests a minute could otherwise send prompts that are refused as too long (400)
without ever meeting its limit, as fast as the gateway tokenizes them (issue 53). Charged first,
every request counts, refused or not, and past the limit it is a 429 before its prompt is read.

Without an explicit max_tokens, the generation is capped so that its reservation fits what the
key may spend in a minute and what the tenant has left this month: such a request is served
(shorter) rather than refused.

An embeddings request takes the same path (`prepare_embedding`, then `embed`): the same keys,
limits, quota, routing and usage, its reservation and its bill being its input tokens.

One route for the sampling parameters, whichever API a request came by (REST `/v1/completions`
and `/v1/chat/completions`, through FastAPI or the fast path, and the gRPC API, which validates
its call as the REST body it amounts to):

  body (openai_types.py) → `prepare` → `PreparedRequest.params` (worker_pb2.SamplingParams) →
  `stream` wraps it, untouched, in one GenerateRequest per prompt → worker (serve/server.py:
  `params_from_proto`, then `engine.add_request` validates it)

and each layer checks what only it can know, once:

- the body checks each field on its own: its type and range (max_tokens and
  max_completion_tokens in [1, 2**32), the wire's uint32), a 400 naming the field;
- `prepare` checks what depends on the prompt and the limits: every prompt leaves room in the
  context for the max_tokens asked (400 naming max_tokens), or, none asked, works one out (the
  room, capped by the key's per-minute tokens and the tenant's quota); it reserves prompt +
  choices x max_tokens and builds the worker's SamplingParams, every field set once
  (`SamplingRequest.sampling_params`);
- the worker checks what arrives over gRPC once (`SamplingParams.validate` in
  `Engine.add_request`), since other clients than this gateway may call it: the ranges again,
  max_tokens against its own context and KV pool, min_tokens against max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from inferplane.api.architectures import ModelKind
from inferplane.api.kv_blocks import adapter_cache_key
from inferplane.api.priority import DEFAULT_BAND, resolve_band
from inferplane.api.tokenizer import check_template_kwargs
from inferplane.control_plane.auth import SCOPE_INFER, Principal
from inferplane.control_plane.autoscale.activator import Activator
from inferplane.control_plane.concurrency import (
    InProcessSequenceLimiter,
    SequenceHold,
    SequenceLimiter,
    SequenceLimits,
)
from inferplane.control_plane.errors import (
    ConcurrencyLimited,
    ControlPlaneError,
    InvalidInput,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    ServiceUnavailable,
    UpstreamTimeout,
)
from inferplane.control_plane.gateway.catalog import Catalog, ServedModel
from inferplane.control_plane.gateway.metrics import GatewayMetrics
from inferplane.control_plane.gateway.openai_types import SamplingRequest
from inferplane.control_plane.gateway.prompt_bound import byte_bound
from inferplane.control_plane.gateway.tool_formats import tool_format
from inferplane.control_plane.limits import KeyLimiter, KeyLimits, QuotaTracker
from inferplane.control_plane.routing import (
    Deployment,
    Endpoint,
    Lease,
    NoReplicaAvailable,
    Router,
    RouteRequest,
    StreamBrokenAfterStart,
    is_retryable,
    route_and_stream,
    tenant_cache_salt,
)
from inferplane.control_plane.routing.retry import rpc_code
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from inferplane.control_plane.usage import UsageRecorder
from inferplane.v1 import worker_pb2

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class ChatTools:
    """A chat request's tools as a tool-aware template reads them: OpenAI's tool objects and the
    messages with calls and tool results as fields (tool_formats.template_messages)."""

    tools: list[dict]
    messages: list[dict]


@dataclass
class PreparedRequest:
    """One request: one prompt, or several (`/v1/completions` takes a list), each answered with
    `n` choices; choice `index` is prompt `index // n`'s. `params`: what the worker samples by,
    finished (max_tokens settled); None for an embeddings request, which generates nothing."""

    request_id: str
    principal: Principal
    model: ServedModel
    prompts: list[list[int]]
    params: worker_pb2.SamplingParams | None = None
    reserved: int = 0  # tokens held against the key's limit and the tenant's quota until settled
    settled: bool = False
    tool_format: str | None = None  # the template's tool-call format, when tools were rendered into it
    priority: str = DEFAULT_BAND  # the band the worker schedules its sequences in (priority.resolve_band)
    hold: SequenceHold | None = None  # its sequences counted against concurrency limits until settled

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.params.n if self.params is not None else 1

    @property
    def token_ids(self) -> list[int]:
        """The first prompt's tokens (the only one, except on a batched `/v1/completions`)."""
        return self.prompts[0]

    @property
    def prompt_tokens(self) -> int:
        """Each prompt once, however many choices it has (OpenAI's usage)."""
        return sum(len(p) for p in self.prompts)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


# Above this many characters of text, a request's template rendering and tokenizing run on a thread:
# below it they cost less than the hop (tokenizing 1,000 characters takes well under a millisecond),
# above it they would hold the event loop every tenant needs (a megabyte: seconds). The tokenizer
# releases the interpreter lock while it works (TextTokenizer.encode), so the loop runs meanwhile.
OFF_LOOP_TEXT_CHARS = 1 << 10


async def off_loop(large: bool, work: Callable[[], T]) -> T:
    """`work()` on a thread when `large`, else here (the hop costs more than small work)."""
    return await asyncio.to_thread(work) if large else work()


def _band(principal: Principal, model: ServedModel) -> str:
    """The priority band a request runs in: the tenant's, else the deployment's, lowered (never
    raised) by the key's."""
    return resolve_band(principal.priority, principal.tenant_priority, model.priority)


def _limits(principal: Principal) -> KeyLimits:
    return KeyLimits(requests_per_minute=principal.requests_per_minute, tokens_per_minute=principal.tokens_per_minute)


def _sequence_limits(principal: Principal) -> SequenceLimits:
    return SequenceLimits(key=principal.max_concurrent_sequences, tenant=principal.tenant_max_concurrent_sequences)


class InferenceService:
    def __init__(self, catalog: Catalog, router: Router, channels: WorkerChannels, *, limiter: KeyLimiter,
                 quota: QuotaTracker | None, usage: UsageRecorder | None, salt_secret: bytes,
                 request_timeout: float = 600.0, activator: Activator | None = None,
                 metrics: GatewayMetrics | None = None, sequences: SequenceLimiter | None = None,
                 max_migrations: int = 2):
        self.catalog = catalog
        self.router = router
        self.channels = channels
        self.limiter = limiter
        self.quota = quota
        self.usage = usage
        self.salt_secret = salt_secret
        self.request_timeout = request_timeout
        self._settling: set[asyncio.Task] = set()
        self.activator = activator or Activator()
        self.metrics = metrics
        self.sequences = sequences or InProcessSequenceLimiter()
        self.max_migrations = max_migrations

    def served(self, principal: Principal, model_name: str, kind: ModelKind) -> ServedModel:
        """The model a request names, if the principal may infer and the model is of the kind the
        endpoint serves (400 naming `model` otherwise: a chat request to an embedding model, or an
        embeddings request to a generative one)."""
        principal.require(SCOPE_INFER)
        model = self.catalog.get(model_name, principal.tenant_id)
        if model.kind != kind:
            if model.kind == "embedding":
                message = f"model {model.name!r} is an embedding model; use /v1/embeddings"
            else:
                message = (f"model {model.name!r} is a generative model (chat and completions); /v1/embeddings "
                           "needs an embedding model")
            raise InvalidInput(message, code="wrong_model_kind", param="model")
        return model

    async def prepare(self, principal: Principal, body: SamplingRequest, *,
                      prompts: list[str | list[int]] | None = None, messages: list[dict[str, str]] | None = None,
                      tools: ChatTools | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                      stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> PreparedRequest:
        """The request `body` asks for (its model, n choices, max_tokens, sampling), on `prompts`
        (text or token ids the worker checks against its vocabulary) or `messages` (through the
        chat template). `tools`: rendered through a chat template that has a tool-call format
        (tool_formats.py), with the messages in the form such templates read.
        `chat_template_kwargs`: extra template variables (vLLM's field; Qwen3's `enable_thinking`).
        `stop_token_ids`, `ignore_eos`: the gRPC API's fields, which no REST body has.

        Returns it admitted, its worker SamplingParams finished (see the module docstring)."""
        model = self.served(principal, body.model, "generate")
        fmt = tool_format(model.tokenizer.chat_template) if tools is not None else None
        if messages is not None:
            try:  # the request model refuses reserved names already; this names the field for other callers
                check_template_kwargs(chat_template_kwargs)
            except ValueError as exc:
                raise InvalidInput(str(exc), code="invalid_value", param="chat_template_kwargs") from exc
        await self.charge_request(principal)
        prompts = prompts or []
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        if messages is not None:
            chars += sum(len(str(m.get("content") or "")) for m in messages)
            chars += OFF_LOOP_TEXT_CHARS if tools is not None else 0  # tool schemas: rendered on a thread
        large = chars > OFF_LOOP_TEXT_CHARS
        token_lists = await off_loop(large, lambda: _tokenize(model, prompts, messages, fmt, tools,
                                                              chat_template_kwargs, large))
        prompt_tokens = sum(len(t) for t in token_lists)
        choices = len(token_lists) * body.n
        max_tokens = self._max_tokens(principal, model, token_lists, body.asked_max_tokens(),
                                      "messages" if messages is not None else "prompt", prompt_tokens, choices)
        params = body.sampling_params(max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        prepared = PreparedRequest(uuid.uuid4().hex, principal, model, token_lists, params,
                                   reserved=prompt_tokens + choices * max_tokens, tool_format=fmt,
                                   priority=_band(principal, model))
        await self.admit(prepared, sequences=choices)
        return prepared

    async def prepare_embedding(self, principal: Principal, model: ServedModel,
                                token_lists: list[list[int]]) -> PreparedRequest:
        """An embeddings request, its inputs already tokenized and checked (embeddings.py): it
        reserves its input tokens (nothing is generated) and holds one sequence however many inputs
        it has, since its inputs run in a few forwards and keep nothing on the worker afterwards."""
        prepared = PreparedRequest(uuid.uuid4().hex, principal, model, token_lists,
                                   reserved=sum(len(t) for t in token_lists), priority=_band(principal, model))
        await self.admit(prepared, sequences=1)
        return prepared

    async def charge_request(self, principal: Principal) -> None:
        """Before any work on the prompt: 429 if the tenant's monthly quota is used up, else the
        request taken from the key's requests-per-minute (429 past it). Taken for good: a request
        refused later (a prompt too long, a token limit) has still been one of the key's requests."""
        with self._counted_refusal(principal):
            if self.quota is not None and principal.tenant_id is not None:
                self.quota.check(principal.tenant_id)
            rpm = principal.requests_per_minute
            if principal.key_id is not None and rpm is not None:
                await self.limiter.admit(principal.key_id, KeyLimits(requests_per_minute=rpm), tokens=0)

    async def admit(self, prepared: PreparedRequest, *, sequences: int) -> None:
        """Holds the request's `sequences` against the key's and tenant's concurrency limits, then
        reserves `prepared.reserved` tokens against the tenant's quota and the key's token limit
        (429 or 400 when refused, and nothing held then). The request itself was charged to the
        key's requests per minute before its prompt was tokenized (`charge_request`)."""
        principal = prepared.principal
        tenant = principal.tenant_id
        with self._counted_refusal(principal):
            # Sequences first: unlike a rate-limit admission, a hold is given back without a trace
            # when a later check refuses the request.
            prepared.hold = await self.sequences.acquire(principal.key_id, tenant, _sequence_limits(principal),
                                                         sequences)
            try:
                if self.quota is not None and tenant is not None:
                    self.quota.reserve(tenant, prepared.reserved)
                tpm = principal.tokens_per_minute
                if principal.key_id is not None and tpm is not None:
                    try:
                        await self.limiter.admit(principal.key_id, KeyLimits(tokens_per_minute=tpm),
                                                 tokens=prepared.reserved)
                    except BaseException:
                        if self.quota is not None and tenant is not None:
                            self.quota.release(tenant, prepared.reserved)
                        raise
            except BaseException:
                self._release_sequences(prepared)
                raise
        self._count_admission(principal, "admitted")

    @contextlib.contextmanager
    def _counted_refusal(self, principal: Principal) -> Iterator[None]:
        """Counts a refusal by a limit (concurrency, quota, rate) in the key's admission metric."""
        try:
            yield
        except ConcurrencyLimited:
            self._count_admission(principal, "concurrency_limited")
            raise
        except QuotaExceeded:
            self._count_admission(principal, "quota_exceeded")
            raise
        except RateLimited:
            self._count_admission(principal, "rate_limited")
            raise

    def _max_tokens(self, principal: Principal, model: ServedModel, token_lists: list[list[int]],
                    asked: int | None, param: str, prompt_tokens: int, choices: int) -> int:
        """The request's max_tokens, its one check against the prompts: the one `asked` for, if
        every prompt (in order) leaves room for it in the context (400 naming max_tokens, or the
        prompt when one leaves no room at all), else the room the longest leaves, capped as
        `_implicit_max_tokens` says. The body checked its range already."""
        room = min(self._room(model, token_ids, asked, param) for token_ids in token_lists)
        if asked is not None:
            return asked
        with self._counted_refusal(principal):
            return self._implicit_max_tokens(principal, _limits(principal), prompt_tokens, room, choices)

    @staticmethod
    def _room(model: ServedModel, token_ids: list[int], max_tokens: int | None, param: str) -> int:
        """Tokens a prompt leaves to generate in the context (400 if none, or fewer than max_tokens)."""
        if not token_ids:
            raise InvalidInput(f"{param} must not be empty", code="invalid_value", param=param)
        room = model.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidInput(f"This model's maximum context length is {model.max_model_len} tokens; "
                               f"the {param} has {len(token_ids)} tokens.", code="context_length_exceeded",
                               param=param)
        if max_tokens is not None and max_tokens > room:
            raise InvalidInput(f"This model's maximum context length is {model.max_model_len} tokens; "
                               f"the {param} has {len(token_ids)} tokens and max_tokens is {max_tokens}.",
                               code="context_length_exceeded", param="max_tokens")
        return room

    def _count_admission(self, principal: Principal, result: str) -> None:
        if self.metrics is not None and principal.key_id is not None:
            self.metrics.key_admission(principal.tenant_id, principal.key_id, result)

    def _implicit_max_tokens(self, principal: Principal, limits: KeyLimits, prompt_tokens: int, room: int,
                             choices: int = 1) -> int:
        """The context room, capped by what the key may spend per minute and the tenant has left
        (shared among the choices)."""
        cap = room
        if limits.tokens_per_minute is not None:
            cap = min(cap, (limits.tokens_per_minute - prompt_tokens) // choices)
            if cap < 1:
                raise RequestTooLarge(f"the prompt has {prompt_tokens} tokens; this key allows "
                                      f"{limits.tokens_per_minute} tokens per minute, prompt and completion together")
        if self.quota is not None and principal.tenant_id is not None:
            remaining = self.quota.remaining(principal.tenant_id)
            if remaining is not None:
                cap = min(cap, (remaining - prompt_tokens) // choices)
                if cap < 1:
                    raise self.quota.exceeded(principal.tenant_id, f"the prompt has {prompt_tokens} tokens and "
                                              f"{remaining} tokens of this month's quota are left")
        return cap

    @contextlib.contextmanager
    def settled_on_error(self, prepared: PreparedRequest) -> Iterator[None]:
        """Gives a prepared request's reservation back if it fails before its stream ever ran."""
        try:
            yield
        except BaseException:
            self.settle(prepared, 0, served=False)
            raise

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The worker's answers to a prepared request: each prompt sent, with `prepared.params` as
        they are, to a replica of its model (its adapter's base), routed by prefix and load;
        settled at the end however it ends."""
        model = prepared.model
        tenant = prepared.principal.tenant_id
        salt = ""
        if model.cache_isolation == "tenant" and tenant is not None:
            salt = tenant_cache_salt(tenant, self.salt_secret)
        completion_tokens = 0
        served = False  # a worker answered: only then is there anything to bill

        async def replica_stream(token_ids: list[int], part: int) -> AsyncIterator[worker_pb2.GenerateResponse]:
            """One prompt's answer from a replica. A replica that fails mid-answer hands it to
            another (`max_migrations` times in all at most), which continues after the tokens
            delivered so far, each unfinished choice as a request of its own: the client's stream
            goes on with no error, no token twice or missing."""
            request_id = prepared.request_id if len(prepared.prompts) == 1 else f"{prepared.request_id}-{part}"
            failed: list[str] = []  # one entry per migration: the replica that failed

            def attempt(params: worker_pb2.SamplingParams, resumed: list[int],
                        choice: int) -> AsyncIterator[worker_pb2.GenerateResponse]:
                request = worker_pb2.GenerateRequest(
                    request_id=request_id if choice == 0 else f"{request_id}#{choice}", params=params,
                    cache_salt=salt, token_ids=worker_pb2.TokenIds(ids=token_ids), tenant=tenant or "",
                    priority=prepared.priority, adapter=adapter, resumed_token_ids=resumed, choice_index=choice)

                routed = RouteRequest(route, token_ids=token_ids + resumed, cache_salt=salt, adapter=adapter_route)
                picked: list[Lease] = []

                def call(endpoint):
                    deployment = picked[-1].deployment
                    if not resumed and deployment.prefill is not None and self.router.uncached_tokens(
                            deployment, endpoint.address, routed) >= deployment.min_prefill_tokens:
                        return self._disaggregated(deployment, endpoint, request, routed)
                    if deployment.prefill is not None and self.metrics is not None:
                        self.metrics.disaggregation.labels("decode_only" if not resumed else "resumed").inc()
                    return self.channels.stub(endpoint.address).Generate(request, timeout=self.request_timeout)

                # aclosing: a client that goes away closes this generator, and that must close the
                # worker call at once (freeing its blocks), not whenever it is collected.
                return contextlib.aclosing(route_and_stream(self.router, routed, call, exclude=list(failed),
                                                            on_pick=picked.append))

            breaks: list[StreamBrokenAfterStart] = []

            def moved(broken: StreamBrokenAfterStart) -> None:
                if not self._migratable(broken, len(failed)):
                    raise broken
                breaks.append(broken)
                failed.append(broken.endpoint)
                if self.metrics is not None:
                    self.metrics.migrations.labels(_migration_cause(broken)).inc()

            # What continues a choice elsewhere: one choice, no prompt logprobs (they came first).
            single = worker_pb2.SamplingParams()
            single.CopyFrom(prepared.params)
            single.n = 1
            single.ClearField("prompt_logprobs")

            async def continued(choice: int, delivered: list[int]) -> AsyncIterator[worker_pb2.GenerateResponse]:
                while True:
                    try:
                        async with attempt(single, delivered, choice) as messages:
                            async for message in messages:
                                delivered += message.token_ids
                                yield message
                        return
                    except StreamBrokenAfterStart as broken:
                        moved(broken)
                    except NoReplicaAvailable as none_left:
                        # No other replica could take it: the answer stays broken, as the client sees it.
                        raise breaks[-1] from none_left

            n = max(1, prepared.params.n)
            delivered: dict[int, list[int]] = {i: [] for i in range(n)}
            finished: set[int] = set()
            try:
                async with attempt(prepared.params, [], 0) as messages:
                    async for message in messages:
                        delivered[message.index] += message.token_ids
                        if message.finished:
                            finished.add(message.index)
                        yield message
                return
            except StreamBrokenAfterStart as broken:
                moved(broken)
            rest = [continued(i, delivered[i]) for i in range(n) if i not in finished]
            async with contextlib.aclosing(merged(rest, 0)) as messages:
                async for message in messages:
                    yield message

        # An adapter is served by its base's replicas, which load it by URI and digest.
        route = model.route_name
        adapter, adapter_route = None, ""
        if model.adapter is not None:
            adapter = worker_pb2.Adapter(name=model.name, uri=model.adapter.uri, sha256=model.adapter.sha256)
            adapter_route = adapter_cache_key(model.name, model.adapter.sha256)  # as the worker names it
        try:
            # A model scaled to zero: wait (bounded) for the replica the autoscaler starts.
            await self.activator.wait_for_replica(route, lambda: self.router.has_replicas(route))
            if len(prepared.prompts) == 1:
                messages = replica_stream(prepared.token_ids, 0)
            else:  # each prompt routed on its own (its own prefix), answers merged as they come
                messages = merged([replica_stream(p, i) for i, p in enumerate(prepared.prompts)], prepared.n)
            async for message in messages:
                served = True
                completion_tokens += len(message.token_ids)
                yield message
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc
        except StreamBrokenAfterStart as exc:
            # A worker that refuses the request after it began answering (a structured output its
            # grammar engine gave up on: INVALID_ARGUMENT naming the field) is the request's error,
            # a 400 (an error event when streaming), not a replica failure.
            cause = exc.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise _worker_error(cause) from exc
            raise
        finally:
            self._account(prepared, completion_tokens, served)

    async def _disaggregated(self, deployment: Deployment, decode: Endpoint, request: worker_pb2.GenerateRequest,
                             routed: RouteRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """A request through `deployment`'s prefill pool: a prefill replica computes the prompt and
        each choice's first token (max_tokens 1), keeping the prompt's KV; then the decode replica
        `decode` continues each choice after its first token (`resumed_token_ids`, as a migrated
        request does: the same draws, grammar state and text), pulling the KV from the prefill
        replica (`kv_source`) instead of computing it. Where the prefill pool has no replica or
        fails before its token, the decode replica computes the prompt itself: the pool is a
        speed-up, never a new way to fail."""
        first = worker_pb2.GenerateRequest()
        first.CopyFrom(request)
        first.params.max_tokens = 1
        first.params.min_tokens = min(first.params.min_tokens, 1)
        calls: list[Any] = []  # every worker call opened here, cancelled however this ends

        def open_call(address: str, message: worker_pb2.GenerateRequest):
            call = self.channels.stub(address).Generate(message, timeout=self.request_timeout)
            calls.append(call)
            return call

        try:
            started = time.perf_counter()
            prefilled, source = await self._prefill(deployment, routed, first, open_call)
            if self.metrics is not None:
                self.metrics.disaggregation.labels("prefilled" if prefilled else "prefill_unavailable").inc()
            if not prefilled:
                async for message in open_call(decode.address, request):
                    yield message
                return
            if self.metrics is not None:
                self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            # Read before anything is yielded: a caller may renumber the messages (merged() makes a
            # batched /v1/completions prompt's choice indexes the request's).
            first_tokens: dict[int, list[int]] = {}
            finished: set[int] = set()
            for message in prefilled:
                first_tokens.setdefault(message.index, []).extend(message.token_ids)
                if message.finish_reason == "length" and request.params.max_tokens != 1:
                    # The prefill's own limit, not the request's: the choice goes on on the decode replica.
                    message.finished = False
                    message.finish_reason = ""
                    message.ClearField("usage")
                elif message.finished:
                    finished.add(message.index)
            continuations = [_continuation(request, index, first_tokens[index], source)
                             for index in sorted(set(first_tokens) - finished)]
            for message in prefilled:
                yield message
            streams = [open_call(decode.address, continued) for continued in continuations]
            if len(streams) == 1:
                async for message in streams[0]:
                    yield message
            elif streams:
                async with contextlib.aclosing(merged(streams, 0)) as messages:
                    async for message in messages:
                        yield message
        finally:
            for call in calls:
                call.cancel()  # a no-op on a finished call; frees the worker's blocks on a client gone

    async def _prefill(self, deployment: Deployment, routed: RouteRequest, first: worker_pb2.GenerateRequest,
                       open_call: Callable[[str, worker_pb2.GenerateRequest], Any],
                       ) -> tuple[list[worker_pb2.GenerateResponse], str]:
        """The prefill replica's answer to `first` (every choice's first token) and its address; ([], "")
        where the pool has no replica or the one picked failed (a request error is raised: it is the
        request's, as the decode replica would answer it too)."""
        try:
            lease = self.router.pick_prefill(deployment, routed)
        except NoReplicaAvailable:  # none, or every one at its limit: the decode replica computes it
            return [], ""
        prefilled: list[worker_pb2.GenerateResponse] = []
        verdict: bool | None = None
        try:
            async for message in open_call(lease.address, first):
                prefilled.append(message)
            verdict = True
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise  # the request's own error (a 400), as the decode replica would answer it
            # Anything else (the replica gone, draining, timed out, failed) is the pool's: the
            # decode replica computes the prompt, so the pool never adds a way to fail.
            verdict = False if is_retryable(exc) else None  # a replica failure counts against its health
            prefilled = []
            log.warning("prefill replica %s failed (%s): the decode replica computes the prompt",
                        lease.address, exc.code().name)
        finally:
            lease.release(verdict)
        return prefilled, lease.address

    def _migratable(self, broken: StreamBrokenAfterStart, migrations: int) -> bool:
        """Whether a stream broken mid-answer moves to another replica: the replica failed (not the
        request: a grammar's refusal stays the request's error) and migrations are left."""
        return migrations < self.max_migrations and broken.__cause__ is not None and is_retryable(broken.__cause__)

    async def embed(self, prepared: PreparedRequest) -> worker_pb2.EmbedResponse:
        """The inputs' vectors from one replica, routed by load alone (an encoder keeps no prefix
        cache to aim for) and retried elsewhere while no replica has answered, as a stream is
        before its first message; settled once answered or failed (usage: the input tokens)."""
        model = prepared.model
        request = worker_pb2.EmbedRequest(request_id=prepared.request_id,
                                          inputs=[worker_pb2.TokenIds(ids=ids) for ids in prepared.prompts],
                                          tenant=prepared.principal.tenant_id or "")

        async def call(endpoint) -> AsyncIterator[worker_pb2.EmbedResponse]:
            yield await self.channels.stub(endpoint.address).Embed(request, timeout=self.request_timeout)

        answer: worker_pb2.EmbedResponse | None = None
        try:
            await self.activator.wait_for_replica(model.name, lambda: self.router.has_replicas(model.name))
            # Read to the end (one message), so the replica's lease is released as a success.
            async for message in route_and_stream(self.router, RouteRequest(model.name), call):
                answer = message
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc
        finally:
            self.settle(prepared, 0, served=answer is not None)
        if answer is None or len(answer.embeddings) != len(prepared.prompts):
            raise ServiceUnavailable("the model replica answered without every input's embedding")
        return answer

    def _account(self, prepared: PreparedRequest, completion_tokens: int, served: bool) -> None:
        self.settle(prepared, completion_tokens, served=served)

    def settle(self, prepared: PreparedRequest, completion_tokens: int, *, served: bool) -> None:
        """Once per request: give its sequences back, bill the tenant only if a worker served it (no
        replica, or a failure before the first token, is a metric, not usage), give the quota
        reservation back once the usage is recorded, and refund the key's bucket what the
        reservation did not use."""
        if prepared.settled:
            return
        prepared.settled = True
        self._release_sequences(prepared)  # first: nothing below may keep a slot taken
        principal = prepared.principal
        used = prepared.prompt_tokens + completion_tokens if served else 0
        if served and self.usage is not None and principal.tenant_id is not None:
            self.usage.record(principal.tenant_id, prepared.model.name, prompt_tokens=prepared.prompt_tokens,
                              completion_tokens=completion_tokens)
            if self.metrics is not None:
                self.metrics.billed(principal.tenant_id, prepared.model.name, prompt_tokens=prepared.prompt_tokens,
                                    completion_tokens=completion_tokens)
        if self.quota is not None and principal.tenant_id is not None:
            self.quota.release(principal.tenant_id, prepared.reserved)
        if principal.key_id is not None and used != prepared.reserved:
            # Not awaited here: this runs in a stream's `finally`, possibly while it is being cancelled.
            task = asyncio.get_running_loop().create_task(
                self.limiter.adjust(principal.key_id, _limits(principal), used - prepared.reserved))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    def _release_sequences(self, prepared: PreparedRequest) -> None:
        """Gives the request's sequences back, once (a second call finds no hold)."""
        hold, prepared.hold = prepared.hold, None
        if hold is not None:
            self.sequences.release(hold)


def _tokenize(model: ServedModel, prompts: list[str | list[int]], messages: list[dict] | None, fmt: str | None,
              tools: ChatTools | None, template_kwargs: dict[str, Any] | None, large: bool) -> list[list[int]]:
    """Each prompt's token ids: `messages` through the chat template (then the one prompt), text
    through the tokenizer, ids as they are. A large text that cannot fit the context is refused
    without tokenizing it (prompt_bound.py; worked out here, on the thread of a large prompt)."""
    param = "prompt"
    if messages is not None:
        param = "messages"
        try:
            if fmt is not None and tools is not None:
                text = model.tokenizer.apply_chat_template(tools.messages, add_generation_prompt=True,
                                                           tools=tools.tools, template_kwargs=template_kwargs)
            else:
                text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           template_kwargs=template_kwargs)
        except ValueError as exc:
            raise InvalidInput(str(exc), code="invalid_messages", param="messages") from exc
        prompts = [text]
    bound = byte_bound(model.tokenizer) if large else None
    texts = [p for p in prompts if isinstance(p, str)] if bound is not None else []
    for text in texts:  # every prompt, before any is tokenized
        if bound is not None and bound.cannot_fit(text, model.max_model_len - 1):
            raise InvalidInput(f"This model's maximum context length is {model.max_model_len} tokens; the {param} "
                               f"has at least {bound.min_tokens(text)} tokens "
                               f"({len(text.encode('utf-8', 'surrogatepass'))} bytes).",
                               code="context_length_exceeded", param=param)
    return [list(p) if isinstance(p, list) else model.tokenizer.encode(p) for p in prompts]


async def merged(streams: list[AsyncIterator[worker_pb2.GenerateResponse]],
                 n: int) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """Several prompts' worker streams as one, each message's `index` made the request's: prompt
    i's choice j is choice i * n + j (OpenAI's order; n 0 keeps the indexes, for the choices of one
    prompt continued as requests of their own). The first failure ends all of them."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(part: int, stream: AsyncIterator[worker_pb2.GenerateResponse]) -> None:
        try:
            async for message in stream:
                message.index += part * n
                await queue.put(message)
            await queue.put(done)
        except Exception as exc:  # handed to the reader, which raises it (cancellation is not)
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _continuation(request: worker_pb2.GenerateRequest, index: int, first_tokens: list[int],
                  source: str) -> worker_pb2.GenerateRequest:
    """Choice `index` of `request` continued after its `first_tokens` on a decode replica, which pulls
    the prompt's KV from the prefill replica `source`: one choice, no prompt logprobs (they came
    with the first token)."""
    continued = worker_pb2.GenerateRequest()
    continued.CopyFrom(request)
    continued.params.n = 1
    continued.params.ClearField("prompt_logprobs")
    continued.request_id = request.request_id if index == 0 else f"{request.request_id}#{index}"
    continued.choice_index = index
    continued.resumed_token_ids[:] = first_tokens
    continued.kv_source = source
    return continued


def _migration_cause(broken: StreamBrokenAfterStart) -> str:
    """Why a stream moved: the failed call's status (UNAVAILABLE: the worker died or its connection
    broke; CANCELLED: it cancelled the stream, as a drain past its grace does)."""
    code = rpc_code(broken.__cause__)
    return code.name.lower() if code is not None else type(broken.__cause__).__name__


def _worker_error(exc: grpc.aio.AioRpcError) -> ControlPlaneError:
    code = exc.code()
    # FAILED_PRECONDITION: the replica serves the other kind of model (Generate to an embedding
    # worker, or Embed to a generative one), which the catalog should have caught: the request's 400.
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        details = exc.details() or "invalid request"
        return InvalidInput(details, code="invalid_value", param=details.split(":", 1)[0] if ":" in details else None)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout("the model did not answer in time")
    # Not the worker's details: they may name files or addresses (routing.retry logged them with
    # the replica's address); the tenant learns that the replica failed, and how.
    return ServiceUnavailable(f"the model replica failed ({code.name})")
