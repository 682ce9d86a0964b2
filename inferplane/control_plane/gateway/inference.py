"""The request path shared by the REST and gRPC tenant APIs.

authenticate (done by the caller) → authorize the model → tokenize and check the context length →
quota and rate limits → route to a replica (prefix affinity, load, retry before the first token) →
stream → record usage off the request path.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from inferplane.control_plane.auth import SCOPE_INFER, Principal
from inferplane.control_plane.gateway.catalog import Catalog, ServedModel
from inferplane.control_plane.gateway.errors import GatewayError
from inferplane.control_plane.gateway.worker_client import WorkerChannels
from inferplane.control_plane.limits import KeyLimits, QuotaTracker, RateLimiter
from inferplane.control_plane.routing import Router, RouteRequest, route_and_stream, tenant_cache_salt
from inferplane.control_plane.usage import UsageRecorder
from inferplane.v1 import worker_pb2


@dataclass
class PreparedRequest:
    request_id: str
    principal: Principal
    model: ServedModel
    token_ids: list[int]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


def _limits(principal: Principal) -> KeyLimits:
    return KeyLimits(requests_per_minute=principal.requests_per_minute, tokens_per_minute=principal.tokens_per_minute)


class InferenceService:
    def __init__(self, catalog: Catalog, router: Router, channels: WorkerChannels, *, limiter: RateLimiter,
                 quota: QuotaTracker | None, usage: UsageRecorder | None, salt_secret: bytes,
                 request_timeout: float = 600.0):
        self.catalog = catalog
        self.router = router
        self.channels = channels
        self.limiter = limiter
        self.quota = quota
        self.usage = usage
        self.salt_secret = salt_secret
        self.request_timeout = request_timeout

    def prepare(self, principal: Principal, model_name: str, *, prompt: str | None = None,
                messages: list[dict[str, str]] | None = None, max_tokens: int | None = None) -> PreparedRequest:
        principal.require(SCOPE_INFER)
        model = self.catalog.get(model_name, principal.tenant_id)
        if messages is not None:
            try:
                prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except ValueError as exc:
                raise GatewayError(400, str(exc), "invalid_messages", "messages") from exc
        token_ids = model.tokenizer.encode(prompt or "")
        param = "messages" if messages is not None else "prompt"
        if not token_ids:
            raise GatewayError(400, f"{param} must not be empty", "invalid_value", param)
        room = model.max_model_len - len(token_ids)
        if room < 1:
            raise GatewayError(400, f"This model's maximum context length is {model.max_model_len} tokens; "
                               f"the {param} has {len(token_ids)} tokens.", "context_length_exceeded", param)
        if max_tokens is not None and max_tokens > room:
            raise GatewayError(400, f"This model's maximum context length is {model.max_model_len} tokens; "
                               f"the {param} has {len(token_ids)} tokens and max_tokens is {max_tokens}.",
                               "context_length_exceeded", "max_tokens")
        if self.quota is not None and principal.tenant_id is not None:
            self.quota.check(principal.tenant_id)
        if principal.key_id is not None:
            self.limiter.admit(principal.key_id, _limits(principal), tokens=len(token_ids))
        return PreparedRequest(uuid.uuid4().hex, principal, model, token_ids, max_tokens or room)

    async def stream(self, prepared: PreparedRequest,
                     params: worker_pb2.SamplingParams) -> AsyncIterator[worker_pb2.GenerateResponse]:
        model = prepared.model
        tenant = prepared.principal.tenant_id
        salt = ""
        if model.cache_isolation == "tenant" and tenant is not None:
            salt = tenant_cache_salt(tenant, self.salt_secret)
        params.max_tokens = prepared.max_tokens
        request = worker_pb2.GenerateRequest(request_id=prepared.request_id, params=params, cache_salt=salt,
                                             token_ids=worker_pb2.TokenIds(ids=prepared.token_ids))
        route = RouteRequest(model.name, token_ids=prepared.token_ids, cache_salt=salt)
        completion_tokens = 0
        served = False  # a worker answered: only then is there anything to bill

        def call(endpoint):
            return self.channels.stub(endpoint.address).Generate(request, timeout=self.request_timeout)

        try:
            async for message in route_and_stream(self.router, route, call):
                served = True
                completion_tokens += len(message.token_ids)
                yield message
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(exc) from exc
        finally:
            self._account(prepared, completion_tokens, served)

    def _account(self, prepared: PreparedRequest, completion_tokens: int, served: bool) -> None:
        """Charge the key's token bucket for what was generated; bill the tenant only for a request
        a worker served (no replica, or a failure before the first token, is a metric, not usage)."""
        principal = prepared.principal
        if principal.key_id is not None:
            self.limiter.charge(principal.key_id, _limits(principal), completion_tokens)
        if served and self.usage is not None and principal.tenant_id is not None:
            self.usage.record(principal.tenant_id, prepared.model.name, prompt_tokens=prepared.prompt_tokens,
                              completion_tokens=completion_tokens)


def _worker_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        details = exc.details() or "invalid request"
        return GatewayError(400, details, "invalid_value", details.split(":", 1)[0] if ":" in details else None)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(504, "the model did not answer in time", "timeout")
    return GatewayError(503, f"the model replica failed: {exc.details()}", "upstream_error")
