"""The tenant gRPC API `inferplane.v1.Inference`: the same request path as REST, key in the
`authorization` metadata, errors as gRPC status codes."""

from __future__ import annotations

import grpc

from inferplane.control_plane.errors import ControlPlaneError
from inferplane.control_plane.gateway.context import GatewayContext, bearer
from inferplane.control_plane.gateway.errors import GatewayError, as_error
from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

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
            if not model:
                raise ValueError("model: required")
            prepared = self.ctx.inference.prepare(principal, model, max_tokens=params.max_tokens or None, **prompt)
            async for msg in self.ctx.inference.stream(prepared, params):
                out = inference_pb2.CompleteResponse(id=prepared.request_id, text=msg.text, finished=msg.finished,
                                                     finish_reason=msg.finish_reason)
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
