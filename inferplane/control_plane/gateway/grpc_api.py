"""The tenant gRPC API `inferplane.v1.Inference`: the same request path as REST, key in the
`authorization` metadata, errors as gRPC status codes.

Requests are validated by the REST API's own pydantic models (`rest_body`), so both APIs accept
and refuse the same values (a NaN temperature or a 100,000-entry stop list is refused here too);
only the gRPC-specific fields (`stop_token_ids`, `ignore_eos`) are checked on their own.
"""

from __future__ import annotations

from typing import Any

import grpc
from pydantic import ValidationError

from inferplane.control_plane.errors import ControlPlaneError
from inferplane.control_plane.gateway.context import GatewayContext, bearer
from inferplane.control_plane.gateway.errors import GatewayError, as_error, validation_message
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

MAX_STOP_TOKEN_IDS = 64


def rest_body(model: str, params: worker_pb2.SamplingParams, *, prompt: str | None = None,
              messages: list[dict[str, Any]] | None = None) -> CompletionRequest | ChatCompletionRequest:
    """The REST request a gRPC call amounts to, validated by the same model (ValidationError if bad).

    Proto defaults mean "unset": max_tokens 0 (room left in the context), top_p 0, top_k 0,
    repetition_penalty 0.
    """
    fields: dict[str, Any] = {"model": model, "temperature": params.temperature, "top_p": params.top_p or 1.0,
                              "top_k": params.top_k or None, "max_tokens": params.max_tokens or None,
                              "stop": list(params.stop) or None, "presence_penalty": params.presence_penalty,
                              "frequency_penalty": params.frequency_penalty,
                              "repetition_penalty": params.repetition_penalty or 1.0, "min_tokens": params.min_tokens,
                              "logit_bias": {str(k): v for k, v in params.logit_bias.items()} or None,
                              "n": params.n or 1}
    if params.HasField("seed"):
        fields["seed"] = params.seed
    if messages is not None:
        return ChatCompletionRequest.model_validate({**fields, "messages": messages, "logprobs": params.logprobs,
                                                     "top_logprobs": params.top_logprobs or None})
    return CompletionRequest.model_validate({**fields, "prompt": prompt,
                                             "logprobs": params.top_logprobs if params.logprobs else None})

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
           413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
           504: grpc.StatusCode.DEADLINE_EXCEEDED}


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    def _principal(self, context):
        metadata = dict(context.invocation_metadata() or ())
        return self.ctx.tenant_principal(bearer(metadata.get("authorization")))

    async def _run(self, context, model: str, params: worker_pb2.SamplingParams, **prompt):
        try:
            principal = self._principal(context)
            if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
            try:
                body = rest_body(model, params, **prompt)
            except ValidationError as exc:
                raise ValueError(validation_message(exc.errors())[0]) from None
            prepared = await self.ctx.inference.prepare(principal, body.model, max_tokens=body.default_max_tokens(),
                                                        **prompt)
            with self.ctx.inference.settled_on_error(prepared):
                worker_params = body.sampling_params(prepared.max_tokens, want_logprobs=params.logprobs)
                worker_params.stop_token_ids.extend(params.stop_token_ids)
                worker_params.ignore_eos = params.ignore_eos
                async for msg in self.ctx.inference.stream(prepared, worker_params):
                    out = inference_pb2.CompleteResponse(id=prepared.request_id, text=msg.text,
                                                         finished=msg.finished, finish_reason=msg.finish_reason)
                    if params.logprobs:
                        out.token_ids.extend(msg.token_ids)
                        out.logprobs.extend(msg.logprobs)
                        out.top_logprobs.extend(msg.top_logprobs)
                    if msg.finished:
                        out.usage.CopyFrom(msg.usage)
                    yield out
        except ValueError as exc:
            known = isinstance(exc, (ControlPlaneError, GatewayError))
            status, message = as_error(exc)[:2] if known else (400, str(exc))
            await context.abort(_STATUS.get(status, grpc.StatusCode.INTERNAL), message)
        except Exception as exc:
            status, message, _, _ = as_error(exc)
            await context.abort(_STATUS.get(status, grpc.StatusCode.INTERNAL), message)

    async def Complete(self, request, context):
        async for out in self._run(context, request.model, request.params, prompt=request.prompt):
            yield out

    async def Chat(self, request, context):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        if not messages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "messages: must not be empty")
        async for out in self._run(context, request.model, request.params, messages=messages):
            yield out
