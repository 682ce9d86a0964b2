"""The tenant gRPC API `inferplane.v1.Inference`: the same request path as REST, key in the
`authorization` metadata, errors as gRPC status codes.

Requests are validated by the REST API's own pydantic models (`rest_body`), so both APIs accept
and refuse the same values (a NaN temperature or a 100,000-entry stop list is refused here too);
only the gRPC-specific fields (`stop_token_ids`, `ignore_eos`) are checked on their own; a constraint
in `params` and `tools`/`tool_choice` become the REST fields they mean (response_format, vLLM's
structured_outputs, tools), so they are validated there too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from pydantic import ValidationError

from inferplane.control_plane.errors import ControlPlaneError
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.embeddings import OFF_LOOP_FLOATS, Embeddings, floats
from inferplane.control_plane.gateway.errors import as_error, validation_message
from inferplane.control_plane.gateway.inference import ChatTools
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from inferplane.control_plane.gateway.tool_formats import held_answer
from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

MAX_STOP_TOKEN_IDS = 64


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice")


def _constraint_fields(params: worker_pb2.SamplingParams, chat: bool) -> dict[str, Any]:
    """The REST fields a gRPC constraint amounts to: response_format on chat for JSON, else vLLM's
    structured_outputs (a JSON spec that does not parse is the worker's 400, as on REST)."""
    kind, spec = params.constraint_kind, params.constraint_spec
    if not kind:
        return {}
    if kind not in CONSTRAINT_KINDS:
        raise ValueError(f"params.constraint_kind: must be one of {', '.join(CONSTRAINT_KINDS)}; got {kind!r}")
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}} if chat else {"structured_outputs": {"json": {
            "type": "object"}}}
    if kind == "choice":
        try:
            return {"structured_outputs": {"choice": json.loads(spec)}}
        except ValueError:
            raise ValueError("params.constraint_spec: a choice is a JSON list of strings") from None
    key = {"json_schema": "json", "regex": "regex"}[kind]
    return {"structured_outputs": {key: spec}}


def _tool_fields(tools, tool_choice: str) -> dict[str, Any]:
    if not tools and not tool_choice:
        return {}
    functions = []
    for tool in tools:
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else None
        except ValueError:
            raise ValueError(f"tools.{tool.name}.parameters_json: not valid JSON") from None
        functions.append({"type": "function", "function": {"name": tool.name, "description": tool.description or None,
                                                           "parameters": parameters}})
    choice: Any = tool_choice or None
    if tool_choice not in ("", "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": tool_choice}}
    return {"tools": functions or None, "tool_choice": choice}


def rest_body(model: str, params: worker_pb2.SamplingParams, *, prompt: str | None = None,
              messages: list[dict[str, Any]] | None = None, tools=(), tool_choice: str = "",
              ) -> CompletionRequest | ChatCompletionRequest:
    """The REST request a gRPC call amounts to, validated by the same model (ValidationError if bad).

    Proto defaults mean "unset": max_tokens 0 (room left in the context), top_p 0, top_k 0,
    repetition_penalty 0, n 0.
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
    fields.update(_constraint_fields(params, chat=messages is not None))
    if messages is not None:
        return ChatCompletionRequest.model_validate({**fields, "messages": messages, "logprobs": params.logprobs,
                                                     "top_logprobs": params.top_logprobs or None,
                                                     **_tool_fields(tools, tool_choice)})
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
        self.embeddings = Embeddings(ctx)

    async def _principal(self, context):
        metadata = dict(context.invocation_metadata() or ())
        return await self.ctx.authenticate(metadata.get("authorization"), None, None, admin=False)

    async def _run(self, context, model: str, params: worker_pb2.SamplingParams, tools=(), tool_choice: str = "",
                   **prompt):
        try:
            principal = await self._principal(context)
            if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
            try:
                body = rest_body(model, params, tools=tools, tool_choice=tool_choice, **prompt)
            except ValidationError as exc:
                raise ValueError(validation_message(exc.errors())[0]) from None
            chat = isinstance(body, ChatCompletionRequest)
            if chat:
                offered = ChatTools(body.tool_dicts(), prompt["messages"]) if body.offers_tools else None
                given: dict[str, Any] = {"messages": prompt["messages"], "tools": offered}
            else:
                given = {"prompts": body.prompts}
            prepared = await self.ctx.inference.prepare(principal, body, stop_token_ids=params.stop_token_ids,
                                                        ignore_eos=params.ignore_eos, **given)
            # A forced call, or tool_choice auto with a template that has a tool-call format: the
            # choice's text is held back and answered whole, with its calls.
            forced = chat and body.forced_tools is not None
            calling = forced or (chat and body.auto_tools and prepared.tool_format is not None)
            names = {t.function.name for t in body.forced_tools} if forced else {t.name for t in tools}
            held: dict[int, list[str]] = {}
            with self.ctx.inference.settled_on_error(prepared):
                async for msg in self.ctx.inference.stream(prepared):
                    out = inference_pb2.CompleteResponse(id=prepared.request_id, text=msg.text, index=msg.index,
                                                         finished=msg.finished, finish_reason=msg.finish_reason)
                    if calling:
                        held.setdefault(msg.index, []).append(msg.text)
                        out.text = ""
                    if params.logprobs:
                        out.token_ids.extend(msg.token_ids)
                        out.logprobs.extend(msg.logprobs)
                        out.top_logprobs.extend(msg.top_logprobs)
                    if msg.finished:
                        out.usage.CopyFrom(msg.usage)
                        if calling:
                            _answer_call(out, "".join(held.pop(msg.index, [])), forced, prepared.tool_format, names)
                    elif calling and not params.logprobs:
                        continue
                    yield out
        except Exception as exc:  # noqa: BLE001 - every failure becomes the call's status
            await self._abort(context, exc)

    async def Complete(self, request, context):
        async for out in self._run(context, request.model, request.params, prompt=request.prompt):
            yield out

    async def Chat(self, request, context):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        if not messages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "messages: must not be empty")
        async for out in self._run(context, request.model, request.params, messages=messages,
                                   tools=list(request.tools), tool_choice=request.tool_choice):
            yield out


    async def Embed(self, request, context):
        try:
            principal = await self._principal(context)
            if request.texts and request.token_ids:
                raise ValueError("texts and token_ids: give one of them")
            inputs = list(request.texts) if request.texts else [list(t.ids) for t in request.token_ids]
            try:
                body = EmbeddingRequest.model_validate({"model": request.model, "input": inputs,
                                                        "dimensions": request.dimensions or None})
            except ValidationError as exc:
                raise ValueError(validation_message(exc.errors())[0]) from None
            request_id, answer, prompt_tokens = await self.embeddings.vectors(body, principal)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the call's status, as in _run
            await self._abort(context, exc)
        response = inference_pb2.EmbeddingsResponse(id=request_id, dimensions=answer.dimensions)
        response.usage.prompt_tokens = prompt_tokens

        def fill() -> None:
            for vector in answer.embeddings:
                response.data.add().values.extend(floats(vector))

        if len(answer.embeddings) * answer.dimensions > OFF_LOOP_FLOATS:
            await asyncio.to_thread(fill)
        else:
            fill()
        return response

    async def _abort(self, context, exc: Exception) -> None:
        """The gRPC status an error maps to (a ValueError of the request's own is a 400)."""
        if isinstance(exc, ValueError) and not isinstance(exc, ControlPlaneError):
            status, message = 400, str(exc)
        else:
            status, message = as_error(exc)[:2]
        await context.abort(_STATUS.get(status, grpc.StatusCode.INTERNAL), message)


def _answer_call(out: inference_pb2.CompleteResponse, text: str, forced: bool, fmt: str | None,
                 names: set[str]) -> None:
    """A finished choice whose text was held back: its tool_calls and content as
    tool_formats.held_answer answers them (a forced call's JSON is never text, even cut off)."""
    content, calls, out.finish_reason = held_answer(text, out.finish_reason, forced=forced, fmt=fmt, names=names)
    out.text = content or ""
    for call in calls:
        out.tool_calls.add(id=call["id"], name=call["function"]["name"], arguments_json=call["function"]["arguments"])
