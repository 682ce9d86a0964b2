"""The two inference endpoints, `/v1/completions` and `/v1/chat/completions`: body in, response out.

Both run the same request path (prepare → worker stream → JSON or server-sent events) and differ
only in the shape of what they send back, which `_TextShape` and `_ChatShape` describe. The
FastAPI routes (which document the endpoints in the OpenAPI schema) and the fast path (which serves
them, see `fast_path.py`) both call `Completions`, so there is one implementation of each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.responses import Response, StreamingResponse

from inferplane.control_plane.auth import Principal
from inferplane.control_plane.gateway.answer_json import JsonStyle, PiecewiseJSONResponse, TokenJson, in_slices, joined
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


class _Choice:
    """One whole (non-streamed) choice, its logprobs already JSON: per array of OpenAI's logprobs
    object (chat: content; completions: tokens, token_logprobs, top_logprobs, text_offset), the
    items' text as the messages brought them, separators included, gathered into pieces of about
    PIECE characters (encoded as each fills, so the end has little left to do)."""

    PIECE = 1 << 18

    def __init__(self, arrays: int, sep: str) -> None:
        self.text: list[str] = []
        self.final: Message | None = None
        self.sep = sep
        self.arrays: list[list[bytes]] = [[] for _ in range(arrays)]  # the filled pieces
        self.filling: list[list[str]] = [[] for _ in range(arrays)]  # each array's piece being filled
        self.sizes = [0] * arrays  # characters in each piece being filled
        self.empty = [True] * arrays  # no item yet: the next needs no separator

    def extend(self, runs: Sequence[str]) -> None:
        for k, run in enumerate(runs):
            if not run:
                continue
            if not self.empty[k]:
                run = self.sep + run
            self.empty[k] = False
            self.filling[k].append(run)
            self.sizes[k] += len(run)
            if self.sizes[k] >= self.PIECE:
                self._fill(k)

    def _fill(self, k: int) -> None:
        if self.filling[k]:
            self.arrays[k].append("".join(self.filling[k]).encode())
            self.filling[k], self.sizes[k] = [], 0

    def pieces(self, k: int) -> list[bytes]:
        """Array k's items, all of them."""
        self._fill(k)
        return self.arrays[k]


def _reason(msg: Message | None) -> str | None:
    if msg is None:
        return None
    return {"abort": "stop"}.get(msg.finish_reason, msg.finish_reason) or None


def _stop_reason(style: JsonStyle, msg: Message | None) -> list[tuple[str, str]]:
    """vLLM's `stop_reason` field, on a choice that a stop string of the request ended: which one
    (Anthropic's Messages API answers it as `stop_sequence`). Left out otherwise, as OpenAI has no
    such field."""
    if msg is None or not msg.stop_string:
        return []
    return [("stop_reason", style.dumps(msg.stop_string))]


class _Shape:
    """What one endpoint's responses look like: the whole answer, stream chunks, the usage chunk.
    A request has `prepared.choices` choices (n per prompt); every message names its `index`.

    Logprobs, the bulk of a large answer, are written as JSON text as each message arrives
    (answer_json.py): `absorb` for a whole answer, `chunk` for a stream."""

    prefix = ""
    whole_object = chunk_object = ""
    arrays = 0  # arrays of a choice's logprobs object that grow with its tokens

    def __init__(self, body: CompletionRequest | ChatCompletionRequest, prepared: PreparedRequest) -> None:
        self.body = body
        self.prepared = prepared
        self.id = f"{self.prefix}-{prepared.request_id}"
        self.created = int(time.time())
        self.json = JsonStyle(compact=not body.stream)
        self.tokens = TokenJson(prepared.model.tokenizer, self.json)
        self.chunk_opening = self._opening(self.chunk_object)

    def _opening(self, kind: str) -> str:
        """An answer's or chunk's JSON up to its choices' `[`."""
        s = self.json
        return s.obj([("id", s.dumps(self.id)), ("object", s.dumps(kind)), ("created", str(self.created)),
                      ("model", s.dumps(self.body.model))])[:-1] + s.item + s.field("choices") + "["

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

    async def absorb(self, choice: _Choice, msg: Message) -> None:
        """Adds a message to the choice it belongs to, its logprobs written as JSON now."""
        choice.text.append(msg.text)
        if msg.finished:
            choice.final = msg
        runs = await self.logprob_runs(msg)
        if runs is not None:
            choice.extend(runs)

    async def whole(self, choices: dict[int, _Choice]) -> list[bytes]:
        """The whole answer's JSON, in pieces; the loop gets a turn after each choice."""
        s = self.json
        finals = {i: c.final for i, c in choices.items() if c.final is not None}
        pieces = [self._opening(self.whole_object).encode()]
        for count, index in enumerate(sorted(choices)):
            if count:
                pieces.append(s.item.encode())
                await asyncio.sleep(0)
            pieces.extend(self.whole_choice(index, choices[index]))
        pieces.append(("]" + s.item + s.field("usage") + s.dumps(self.usage(finals)) + "}").encode())
        return pieces

    async def chunk(self, msg: Message) -> str | None:
        """A stream chunk's JSON for `msg`, or None when the shape holds it back."""
        return self.chunk_opening + self.json.obj(await self.chunk_choice(msg)) + "]}"

    def final_chunk(self, msg: Message) -> str:
        return self.json.dumps(self.envelope(self.chunk_object, [self.final_choice(msg)]))

    def usage_chunk(self, finals: dict[int, Message]) -> str:
        return self.json.dumps(self.envelope(self.chunk_object, [], finals, with_usage=True))

    async def logprob_runs(self, msg: Message) -> list[str] | None:
        """The message's items of each logprobs array, as JSON (None: no logprobs asked for)."""
        raise NotImplementedError

    def whole_choice(self, index: int, choice: _Choice) -> list[bytes]:
        raise NotImplementedError

    async def chunk_choice(self, msg: Message) -> list[tuple[str, str]]:
        raise NotImplementedError

    def final_choice(self, msg: Message) -> dict:
        raise NotImplementedError


class _TextShape(_Shape):
    prefix = "cmpl"
    whole_object = chunk_object = "text_completion"
    arrays = 4  # tokens, token_logprobs, top_logprobs, text_offset
    body: CompletionRequest

    def __init__(self, body: CompletionRequest, prepared: PreparedRequest) -> None:
        super().__init__(body, prepared)
        # echo: each choice's prompt comes first, in the whole answer or the choice's first chunk.
        self.echoes = [prompt if isinstance(prompt, str) else prepared.model.tokenizer.decode(ids)
                       for prompt, ids in zip(body.prompts, prepared.prompts, strict=True)] if body.echo else []
        self.unechoed = set(range(prepared.choices)) if body.echo else set()
        # Characters returned so far per choice: text_offset counts from the start of its text.
        self.offsets = {i: len(self._echo(i)) for i in range(prepared.choices)}
        self.prompt_runs: dict[int, tuple[str, str]] = {}  # per prompt: its tokens and text_offset items

    def _echo(self, index: int) -> str:
        return self.echoes[index // self.prepared.n] if self.echoes else ""

    def _take_echo(self, index: int) -> str:
        if index not in self.unechoed:
            return ""
        self.unechoed.discard(index)
        return self._echo(index)

    def _top(self, top: worker_pb2.TopLogprobs) -> str:
        """One token's alternatives as OpenAI's completions give them: {text: logprob}, best first
        (two ids with the same text are one key, with the later one's logprob, as a dict makes it)."""
        s, key = self.json, self.tokens.key
        alternatives = {key(i)[0]: lp for i, lp in zip(top.token_ids, top.logprobs, strict=True)}
        return "{" + s.item.join(f"{k}{s.key}{s.number(lp)}" for k, lp in alternatives.items()) + "}"

    def _tops(self, tops) -> Callable[[int, int], str]:
        return lambda start, stop: self.json.item.join(map(self._top, tops[start:stop]))

    async def logprob_runs(self, msg: Message) -> list[str] | None:
        """OpenAI's completions logprobs; with echo, the prompt's tokens first (the first has none)."""
        if self.body.logprobs is None:
            return None
        s, key, index = self.json, self.tokens.key, msg.index
        ids = msg.token_ids

        def offsets(start: int, stop: int) -> str:
            out, position = [], self.offsets[index]
            for i in ids[start:stop]:
                out.append(str(position))
                position += key(i)[1]
            self.offsets[index] = position
            return s.item.join(out)

        runs = [await in_slices(len(ids), lambda a, b: s.item.join(key(i)[0] for i in ids[a:b]), s.item),
                await in_slices(len(msg.logprobs), lambda a, b: s.numbers(msg.logprobs[a:b]), s.item),
                await in_slices(len(msg.top_logprobs), self._tops(msg.top_logprobs), s.item),
                await in_slices(len(ids), offsets, s.item)]
        if self.echoes and msg.prompt_logprobs:
            first = await self._prompt_runs(msg)
            runs = [joined(s.item, pair) for pair in zip(first, runs, strict=True)]
        return runs

    async def _prompt_runs(self, msg: Message) -> list[str]:
        """The prompt's items, ahead of the choice's first tokens: its tokens from offset 0, the first
        token without a logprob (or alternatives), each other scored as the worker says."""
        s, key = self.json, self.tokens.key
        part = msg.index // self.prepared.n
        if part not in self.prompt_runs:  # the same for every choice of the prompt
            ids = self.prepared.prompts[part]
            position = 0

            def offsets(start: int, stop: int) -> str:
                nonlocal position
                out = []
                for i in ids[start:stop]:
                    out.append(str(position))
                    position += key(i)[1]
                return s.item.join(out)

            self.prompt_runs[part] = (
                await in_slices(len(ids), lambda a, b: s.item.join(key(i)[0] for i in ids[a:b]), s.item),
                await in_slices(len(ids), offsets, s.item))
        tokens, offsets_run = self.prompt_runs[part]
        values, tops = msg.prompt_logprobs, msg.prompt_top_logprobs
        scored = await in_slices(len(values), lambda a, b: s.numbers(values[a:b]), s.item)
        top = await in_slices(len(tops), self._tops(tops), s.item)
        return [tokens, joined(s.item, ["null", scored]), joined(s.item, ["null", top]), offsets_run]

    def _logprobs(self, runs: Sequence[str]) -> str:
        """A logprobs object around its arrays' items (top_logprobs null unless asked for)."""
        s = self.json
        top = f"[{runs[2]}]" if self.body.logprobs else "null"
        return s.obj([("tokens", f"[{runs[0]}]"), ("token_logprobs", f"[{runs[1]}]"), ("top_logprobs", top),
                      ("text_offset", f"[{runs[3]}]")])

    def whole_choice(self, index: int, choice: _Choice) -> list[bytes]:
        s = self.json
        head = s.obj([("index", str(index)), ("text", s.dumps(self._take_echo(index) + "".join(choice.text))),
                      ("finish_reason", s.dumps(_reason(choice.final))), *_stop_reason(s, choice.final)])[:-1] \
            + s.item + s.field("logprobs")
        if self.body.logprobs is None:
            return [(head + "null}").encode()]
        # The logprobs object as _logprobs writes it, its arrays' items as they were absorbed.
        names = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        pieces = [(head + "{").encode()]
        for count, name in enumerate(names):
            opening = (s.item if count else "") + s.field(name)
            if name == "top_logprobs" and not self.body.logprobs:
                pieces.append((opening + "null").encode())
                continue
            pieces.append((opening + "[").encode())
            pieces.extend(choice.pieces(count))
            pieces.append(b"]")
        pieces.append(b"}}")
        return pieces

    async def chunk_choice(self, msg: Message) -> list[tuple[str, str]]:
        s = self.json
        runs = await self.logprob_runs(msg)
        return [("index", str(msg.index)), ("text", s.dumps(self._take_echo(msg.index) + msg.text)),
                ("finish_reason", "null"), ("logprobs", "null" if runs is None else self._logprobs(runs))]

    def final_choice(self, msg: Message) -> dict:
        return {"index": msg.index, "text": self._take_echo(msg.index), "finish_reason": _reason(msg),
                **({"stop_reason": msg.stop_string} if msg.stop_string else {}), "logprobs": None}


class _ChatShape(_Shape):
    prefix = "chatcmpl"
    whole_object, chunk_object = "chat.completion", "chat.completion.chunk"
    arrays = 1  # content
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
        # The functions a call may name: a forced call's (the grammar allows only those), else all tools.
        self.tool_names = {t.function.name for t in body.forced_tools or body.tools or []}
        self.call_text: dict[int, list[str]] = {}

    async def logprob_runs(self, msg: Message) -> list[str] | None:
        """logprobs.content's entries: each token {token, logprob, bytes, top_logprobs}, its
        alternatives {token, logprob, bytes}."""
        if not self.body.logprobs:
            return None
        s, entry, number = self.json, self.tokens.entry, self.json.number
        ids, values, tops = msg.token_ids, msg.logprobs, msg.top_logprobs
        with_top = bool(self.body.top_logprobs)
        count = min(len(ids), len(values), len(tops) if with_top else len(ids))

        def alternatives(top: worker_pb2.TopLogprobs) -> str:
            out = []
            for i, lp in zip(top.token_ids, top.logprobs, strict=True):
                head, tail, _ = entry(i)
                out.append(head + number(lp) + tail)
            return s.item.join(out)

        def entries(start: int, stop: int) -> str:
            out = []
            for k in range(start, stop):
                head, _, opening = entry(ids[k])
                out.append(head + number(values[k]) + opening + (alternatives(tops[k]) if with_top else "") + "]}")
            return s.item.join(out)

        return [await in_slices(count, entries, s.item)]

    def _answer(self, text: str, reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, tool_calls, finish_reason) of a whole answer."""
        if not (self.calling or self.parsing):
            return text, None, reason
        content, calls, reason = held_answer(text, reason, forced=self.calling, fmt=self.prepared.tool_format,
                                             names=self.tool_names)
        return content, calls or None, reason

    def whole_choice(self, index: int, choice: _Choice) -> list[bytes]:
        s = self.json
        content, calls, reason = self._answer("".join(choice.text), _reason(choice.final))
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        head = s.obj([("index", str(index)), ("message", s.dumps(message)),
                      ("finish_reason", s.dumps(reason)), *_stop_reason(s, choice.final)])[:-1] \
            + s.item + s.field("logprobs")
        if not self.body.logprobs:
            return [(head + "null}").encode()]
        return [(head + "{" + s.field("content") + "[").encode(), *choice.pieces(0), b"]}}"]

    async def chunk(self, msg: Message) -> str | None:
        if self.calling or self.parsing:
            self.call_text.setdefault(msg.index, []).append(msg.text)
            return None
        return await super().chunk(msg)

    async def chunk_choice(self, msg: Message) -> list[tuple[str, str]]:
        s = self.json
        delta = {"content": msg.text}
        if msg.index not in self.sent_role:
            delta["role"] = "assistant"
            self.sent_role.add(msg.index)
        runs = await self.logprob_runs(msg)
        logprobs = "null" if runs is None else "{" + s.field("content") + f"[{runs[0]}]}}"
        return [("index", str(msg.index)), ("delta", s.dumps(delta)), ("finish_reason", "null"),
                ("logprobs", logprobs)]

    def final_choice(self, msg: Message) -> dict:
        index = msg.index
        stop = {"stop_reason": msg.stop_string} if msg.stop_string else {}
        if not (self.calling or self.parsing):
            return {"index": index, "delta": {}, "finish_reason": _reason(msg), **stop}
        # The held-back answer in one delta: its calls (a forced one cut off by max_tokens with
        # the arguments written so far), or, without a call in the template's format, the text.
        content, calls, reason = self._answer("".join(self.call_text.get(index, [])), _reason(msg))
        delta: dict = {"role": "assistant", "content": content}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"index": index, "delta": delta, "finish_reason": reason, **stop}


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
        prepared = await self.ctx.inference.prepare(principal, body, prompts=body.prompts)
        with self.ctx.inference.settled_on_error(prepared):
            return await self._respond(_TextShape(body, prepared))

    async def chat(self, body: ChatCompletionRequest, principal: Principal) -> Response:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            tools = ChatTools(body.tool_dicts(), template_messages(body.messages)) if body.offers_tools else None
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_value", "messages")
        prepared = await self.ctx.inference.prepare(principal, body, messages=messages, tools=tools,
                                                    chat_template_kwargs=body.chat_template_kwargs)
        with self.ctx.inference.settled_on_error(prepared):
            return await self._respond(_ChatShape(body, prepared))

    async def _respond(self, shape: _Shape) -> Response:
        if shape.body.stream:
            return await self._respond_streaming(shape)
        first, stream = await self._open(shape.prepared)
        choices = {i: _Choice(shape.arrays, shape.json.item) for i in range(shape.prepared.choices)}
        await shape.absorb(choices[first.index], first)
        async for msg in stream:
            await shape.absorb(choices[msg.index], msg)
        self._count_tokens(shape.prepared, {i: c.final for i, c in choices.items() if c.final is not None})
        return PiecewiseJSONResponse(await shape.whole(choices))

    async def _respond_streaming(self, shape: _Shape) -> Response:
        """A failure in the first moments (no replica, bad input) is still a proper HTTP status; a
        request still queued after HEADER_WAIT gets its headers and then SSE comments as
        keep-alives, so a client with a read timeout does not give up while it waits."""
        opening = asyncio.ensure_future(self._open(shape.prepared))
        try:
            done, _ = await asyncio.wait({opening}, timeout=HEADER_WAIT)
        except BaseException:
            opening.cancel()
            raise
        if done:
            first, stream = opening.result()
            return self._sse(shape, _opened(first, stream))
        return self._sse(shape, _opened_with_keepalives(opening))

    async def _open(self, prepared: PreparedRequest):
        """Starts the worker stream and waits for its first message, so that failures before
        the first token still become a proper HTTP status instead of a broken stream."""
        stream = self.ctx.inference.stream(prepared)
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
                    chunk = await shape.chunk(msg) if msg.text or msg.token_ids or msg.prompt_logprobs else None
                    if chunk is not None:
                        yield f"data: {chunk}\n\n"
                    if msg.finished:  # this choice is done; the stream ends when all are
                        finals[msg.index] = msg
                        yield f"data: {shape.final_chunk(msg)}\n\n"
            except Exception as exc:  # broken after the headers went out: a clean error event
                yield sse_error(exc)
                return
            finally:
                await messages.aclose()
            self._count_tokens(shape.prepared, finals)
            if shape.body.include_usage:
                yield f"data: {shape.usage_chunk(finals)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
