"""The two inference endpoints, `/v1/completions` and `/v1/chat/completions`: body in, response out.

Both run the same request path (prepare → worker stream → JSON or server-sent events) and differ
only in the shape of what they send back, which `_TextShape` and `_ChatShape` describe. The
FastAPI routes (which document the endpoints in the OpenAPI schema) and the fast path (which serves
them, see `fast_path.py`) both call `Completions`, so there is one implementation of each.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse

from inferplane.control_plane.auth import Principal
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.errors import error_response, sse_error
from inferplane.control_plane.gateway.inference import ChatTools, PreparedRequest
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from inferplane.control_plane.gateway.tool_formats import held_answer, template_messages
from inferplane.v1 import worker_pb2

# A stream whose first token has not come this soon gets its headers anyway, then a comment every
# KEEPALIVE_INTERVAL: proxies and clients with read timeouts otherwise drop a request still queued.
HEADER_WAIT = 0.5
KEEPALIVE_INTERVAL = 5.0

Message = worker_pb2.GenerateResponse


class _Collected:
    """One whole (non-streamed) choice gathered from the worker stream."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[worker_pb2.TopLogprobs] = []
        self.final: Message | None = None
        self.prompt_scored: Message | None = None  # the message carrying the prompt's logprobs (echo)

    def add(self, msg: Message) -> None:
        if msg.prompt_logprobs:
            self.prompt_scored = msg
        self.text.append(msg.text)
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.top.extend(msg.top_logprobs)
        if msg.finished:
            self.final = msg


def _reason(msg: Message | None) -> str | None:
    if msg is None:
        return None
    return {"abort": "stop"}.get(msg.finish_reason, msg.finish_reason) or None


class _Shape:
    """What one endpoint's responses look like: the whole answer, stream chunks, the usage chunk.
    A request has `prepared.choices` choices (n per prompt); every message names its `index`."""

    prefix = ""
    whole_object = chunk_object = ""

    def __init__(self, body: CompletionRequest | ChatCompletionRequest, prepared: PreparedRequest) -> None:
        self.body = body
        self.prepared = prepared
        self.id = f"{self.prefix}-{prepared.request_id}"
        self.created = int(time.time())

    def envelope(self, kind: str, choices: list[dict], finals: dict[int, Message] | None = None,
                 with_usage: bool = False) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.body.model, "choices": choices}
        if with_usage:
            out["usage"] = self.usage(finals or {})
        return out

    def usage(self, finals: dict[int, Message]) -> dict:
        """Each prompt counted once (however many choices), every choice's completion tokens."""
        prompt = self.prepared.prompt_tokens
        completion = sum(f.usage.completion_tokens for f in finals.values())
        cached = sum(f.usage.cached_tokens for i, f in finals.items() if i % self.prepared.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def token_texts(self, ids) -> list[str]:
        return [self.prepared.model.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def alternatives(self, top) -> list[list[tuple[str, float]]]:
        """Per token: its best alternatives as (text, logprob), best first."""
        return [list(zip(self.token_texts(t.token_ids), t.logprobs, strict=True)) for t in top]

    def whole(self, results: dict[int, _Collected]) -> dict:
        finals = {i: r.final for i, r in results.items() if r.final is not None}
        choices = [self.whole_choice(i, results[i]) for i in sorted(results)]
        return self.envelope(self.whole_object, choices, finals, with_usage=True)

    def chunk(self, msg: Message) -> dict | None:
        """A stream chunk for `msg`, or None when the shape holds it back."""
        return self.envelope(self.chunk_object, [self.chunk_choice(msg)])

    def final_chunk(self, msg: Message) -> dict:
        return self.envelope(self.chunk_object, [self.final_choice(msg)])

    def usage_chunk(self, finals: dict[int, Message]) -> dict:
        return self.envelope(self.chunk_object, [], finals, with_usage=True)

    def whole_choice(self, index: int, result: _Collected) -> dict:
        raise NotImplementedError

    def chunk_choice(self, msg: Message) -> dict:
        raise NotImplementedError

    def final_choice(self, msg: Message) -> dict:
        raise NotImplementedError


class _TextShape(_Shape):
    prefix = "cmpl"
    whole_object = chunk_object = "text_completion"
    body: CompletionRequest

    def __init__(self, body: CompletionRequest, prepared: PreparedRequest) -> None:
        super().__init__(body, prepared)
        # echo: each choice's prompt comes first, in the whole answer or the choice's first chunk.
        self.echoes = [prompt if isinstance(prompt, str) else prepared.model.tokenizer.decode(ids)
                       for prompt, ids in zip(body.prompts, prepared.prompts, strict=True)] if body.echo else []
        self.unechoed = set(range(prepared.choices)) if body.echo else set()
        # Characters returned so far per choice: text_offset counts from the start of its text.
        self.offsets = {i: len(self._echo(i)) for i in range(prepared.choices)}

    def _echo(self, index: int) -> str:
        return self.echoes[index // self.prepared.n] if self.echoes else ""

    def _take_echo(self, index: int) -> str:
        if index not in self.unechoed:
            return ""
        self.unechoed.discard(index)
        return self._echo(index)

    def logprobs(self, index: int, ids, values, top, prompt: Message | None = None) -> dict | None:
        """OpenAI's completions logprobs; with echo, the prompt's tokens first (the first has none)."""
        if self.body.logprobs is None:
            return None
        texts = self.token_texts(ids)
        offsets = []
        for text in texts:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        top_logprobs = [dict(a) for a in self.alternatives(top)] if self.body.logprobs else None
        out = {"tokens": texts, "token_logprobs": list(values), "top_logprobs": top_logprobs, "text_offset": offsets}
        return self._with_prompt(index, out, prompt) if prompt is not None else out

    def _with_prompt(self, index: int, out: dict, prompt: Message) -> dict:
        ids = self.prepared.prompts[index // self.prepared.n]
        texts = self.token_texts(ids)
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        top = [None, *(dict(a) for a in self.alternatives(prompt.prompt_top_logprobs))] if self.body.logprobs else None
        return {"tokens": texts + out["tokens"],
                "token_logprobs": [None, *prompt.prompt_logprobs, *out["token_logprobs"]],
                "top_logprobs": top + out["top_logprobs"] if top is not None else None,
                "text_offset": offsets + out["text_offset"]}

    def whole_choice(self, index: int, result: _Collected) -> dict:
        return {"index": index, "text": self._take_echo(index) + "".join(result.text),
                "finish_reason": _reason(result.final),
                "logprobs": self.logprobs(index, result.token_ids, result.logprobs, result.top,
                                          result.prompt_scored if self.echoes else None)}

    def chunk_choice(self, msg: Message) -> dict:
        prompt = msg if self.echoes and msg.prompt_logprobs else None
        return {"index": msg.index, "text": self._take_echo(msg.index) + msg.text, "finish_reason": None,
                "logprobs": self.logprobs(msg.index, msg.token_ids, msg.logprobs, msg.top_logprobs, prompt)}

    def final_choice(self, msg: Message) -> dict:
        return {"index": msg.index, "text": self._take_echo(msg.index), "finish_reason": _reason(msg),
                "logprobs": None}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


class _ChatShape(_Shape):
    prefix = "chatcmpl"
    whole_object, chunk_object = "chat.completion", "chat.completion.chunk"
    body: ChatCompletionRequest

    def __init__(self, body: ChatCompletionRequest, prepared: PreparedRequest) -> None:
        super().__init__(body, prepared)
        self.sent_role: set[int] = set()
        # A forced tool call streams as one delta once its JSON is complete: arguments are only
        # useful whole, and the call's id and name come with it.
        self.calling = body.forced_tools is not None
        # tool_choice auto with a template that has a tool-call format: the answer is held back
        # too, and calls in that format are parsed out of it at the end (tool_formats.py).
        self.parsing = body.auto_tools and prepared.tool_format is not None
        self.tool_names = {t.function.name for t in body.tools or []}
        self.call_text: dict[int, list[str]] = {}

    def logprobs(self, ids, values, top) -> dict | None:
        if not self.body.logprobs:
            return None
        alternatives = self.alternatives(top) if self.body.top_logprobs else [[] for _ in ids]
        return {"content": [{**_entry(t, lp), "top_logprobs": [_entry(a, alp) for a, alp in alt]}
                            for t, lp, alt in zip(self.token_texts(ids), values, alternatives, strict=False)]}

    def _answer(self, text: str, reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, tool_calls, finish_reason) of a whole answer."""
        if not (self.calling or self.parsing):
            return text, None, reason
        content, calls, reason = held_answer(text, reason, forced=self.calling, fmt=self.prepared.tool_format,
                                             names=self.tool_names)
        return content, calls or None, reason

    def whole_choice(self, index: int, result: _Collected) -> dict:
        content, calls, reason = self._answer("".join(result.text), _reason(result.final))
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "finish_reason": reason,
                "logprobs": self.logprobs(result.token_ids, result.logprobs, result.top)}

    def chunk(self, msg: Message) -> dict | None:
        if self.calling or self.parsing:
            self.call_text.setdefault(msg.index, []).append(msg.text)
            return None
        return super().chunk(msg)

    def chunk_choice(self, msg: Message) -> dict:
        delta = {"content": msg.text}
        if msg.index not in self.sent_role:
            delta["role"] = "assistant"
            self.sent_role.add(msg.index)
        return {"index": msg.index, "delta": delta, "finish_reason": None,
                "logprobs": self.logprobs(msg.token_ids, msg.logprobs, msg.top_logprobs)}

    def final_choice(self, msg: Message) -> dict:
        index = msg.index
        if not (self.calling or self.parsing):
            return {"index": index, "delta": {}, "finish_reason": _reason(msg)}
        # The held-back answer in one delta: its calls, or (none, or cut off before a call
        # closed) what was written, as text.
        content, calls, reason = self._answer("".join(self.call_text.get(index, [])), _reason(msg))
        delta: dict = {"role": "assistant", "content": content}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"index": index, "delta": delta, "finish_reason": reason}


async def _opened(first: Message, stream: AsyncIterator[Message]) -> AsyncIterator[Message | str]:
    try:
        yield first
        async for msg in stream:
            yield msg
    finally:
        await stream.aclose()


async def _opened_with_keepalives(opening: asyncio.Future) -> AsyncIterator[Message | str]:
    """SSE comments until the worker stream opens, then its messages; its failure surfaces here."""
    stream = None
    try:
        yield ": queued\n\n"
        while not (await asyncio.wait({opening}, timeout=KEEPALIVE_INTERVAL))[0]:
            yield ": keep-alive\n\n"
        first, stream = opening.result()
        yield first
        async for msg in stream:
            yield msg
    finally:
        if not opening.done():  # the client left while queued: cancelling closes the worker stream
            opening.cancel()
        if stream is not None:
            await stream.aclose()


class Completions:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def text(self, body: CompletionRequest, principal: Principal) -> Response:
        prepared = await self.ctx.inference.prepare(principal, body.model, prompts=body.prompts, n=body.n,
                                                    max_tokens=body.default_max_tokens())
        with self.ctx.inference.settled_on_error(prepared):
            params = body.sampling_params(prepared.max_tokens, want_logprobs=body.logprobs is not None)
            return await self._respond(_TextShape(body, prepared), params)

    async def chat(self, body: ChatCompletionRequest, principal: Principal) -> Response:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            tools = ChatTools(body.tool_dicts(), template_messages(body.messages)) if body.offers_tools else None
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_value", "messages")
        prepared = await self.ctx.inference.prepare(principal, body.model, messages=messages, n=body.n,
                                                    max_tokens=body.default_max_tokens(), tools=tools)
        with self.ctx.inference.settled_on_error(prepared):
            params = body.sampling_params(prepared.max_tokens, want_logprobs=body.logprobs)
            return await self._respond(_ChatShape(body, prepared), params)

    async def _respond(self, shape: _Shape, params: worker_pb2.SamplingParams) -> Response:
        if shape.body.stream:
            return await self._respond_streaming(shape, params)
        first, stream = await self._open(shape.prepared, params)
        results = {i: _Collected() for i in range(shape.prepared.choices)}
        results[first.index].add(first)
        async for msg in stream:
            results[msg.index].add(msg)
        self._count_tokens(shape.prepared, {i: r.final for i, r in results.items() if r.final is not None})
        return JSONResponse(shape.whole(results))

    async def _respond_streaming(self, shape: _Shape, params: worker_pb2.SamplingParams) -> Response:
        """A failure in the first moments (no replica, bad input) is still a proper HTTP status; a
        request still queued after HEADER_WAIT gets its headers and then SSE comments as
        keep-alives, so a client with a read timeout does not give up while it waits."""
        opening = asyncio.ensure_future(self._open(shape.prepared, params))
        try:
            done, _ = await asyncio.wait({opening}, timeout=HEADER_WAIT)
        except BaseException:
            opening.cancel()
            raise
        if done:
            first, stream = opening.result()
            return self._sse(shape, _opened(first, stream))
        return self._sse(shape, _opened_with_keepalives(opening))

    async def _open(self, prepared: PreparedRequest, params: worker_pb2.SamplingParams):
        """Starts the worker stream and waits for its first message, so that failures before
        the first token still become a proper HTTP status instead of a broken stream."""
        stream = self.ctx.inference.stream(prepared, params)
        start = time.perf_counter()
        first = await anext(stream)
        self.ctx.metrics.ttft.labels(prepared.model.name).observe(time.perf_counter() - start)
        return first, stream

    def _count_tokens(self, prepared: PreparedRequest, finals: dict[int, Message]) -> None:
        if finals:
            self.ctx.metrics.tokens.labels(prepared.model.name, "prompt").inc(prepared.prompt_tokens)
            self.ctx.metrics.tokens.labels(prepared.model.name, "completion").inc(
                sum(f.usage.completion_tokens for f in finals.values()))

    def _sse(self, shape: _Shape, messages: AsyncIterator[Message | str]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            finals: dict[int, Message] = {}
            try:
                async for msg in messages:
                    if isinstance(msg, str):  # a keep-alive comment while queued
                        yield msg
                        continue
                    chunk = shape.chunk(msg) if msg.text or msg.token_ids or msg.prompt_logprobs else None
                    if chunk is not None:
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if msg.finished:  # this choice is done; the stream ends when all are
                        finals[msg.index] = msg
                        yield f"data: {json.dumps(shape.final_chunk(msg))}\n\n"
            except Exception as exc:  # broken after the headers went out: a clean error event
                yield sse_error(exc)
                return
            finally:
                await messages.aclose()
            self._count_tokens(shape.prepared, finals)
            if shape.body.include_usage:
                yield f"data: {json.dumps(shape.usage_chunk(finals))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
