"""`/v1/embeddings`: an OpenAI embeddings body in, OpenAI's list of vectors out.

The path: the model, which must be an embedding model (400 naming its kind otherwise) →
`dimensions`, which may only restate the model's own size (BERT models are not trained to be
shortened; truncating a Matryoshka model's vectors would be the place to add it) → the inputs
tokenized as the model reads them, special tokens included ([CLS] ... [SEP], as
sentence-transformers does; token-id inputs are taken as they are), each within the model's
positions (400 naming `input`: OpenAI refuses, it does not truncate) → the completions' admission
(`InferenceService.prepare_embedding`: keys, concurrency, quota, rate limits) → one replica's
Embed → JSON with each vector as floats, or as base64 of its little-endian float32 bytes (what
OpenAI sends, and what its client decodes).

The gateway tokenizes, not the worker: so an over-long input is a 400 before any replica is
involved and the request's tokens are known when its reservation is made, as for completions.
Up to 2048 inputs fit in one request: tokenizing them and writing their vectors as JSON take
tens of milliseconds, done on a thread above a small size so the event loop keeps serving.
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import sys
from collections.abc import Callable
from typing import TypeVar

from starlette.responses import Response

from inferplane.control_plane.auth import Principal
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.openai_types import EmbeddingRequest
from inferplane.v1 import worker_pb2

T = TypeVar("T")

# Above these, tokenizing or writing the answer runs on a thread (see the module's docstring).
OFF_LOOP_TEXT_CHARS = 32 << 10
OFF_LOOP_FLOATS = 32 << 10


async def _run(large: bool, work: Callable[[], T]) -> T:
    return await asyncio.to_thread(work) if large else work()


def check_dimensions(body: EmbeddingRequest, model: ServedModel) -> None:
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise InvalidInput(f"dimensions: model {model.name!r} gives {model.dimensions}-dimensional embeddings "
                           "and cannot shorten them (it is not a Matryoshka model); leave dimensions out or "
                           f"send {model.dimensions}", code="invalid_value", param="dimensions")


def tokenize(model: ServedModel, inputs: list[str] | list[list[int]]) -> list[list[int]]:
    """Each input's token ids, every one checked against the model's positions."""
    if isinstance(inputs[0], str):
        token_lists = model.tokenizer.encode_inputs(inputs)  # type: ignore[arg-type]
    else:
        token_lists = [list(ids) for ids in inputs]  # type: ignore[arg-type]
    for i, ids in enumerate(token_lists):
        if len(ids) > model.max_model_len:
            where = f"input item {i}" if len(token_lists) > 1 else "the input"
            raise InvalidInput(f"This model's maximum context length is {model.max_model_len} tokens; "
                               f"{where} has {len(ids)} tokens.", code="context_length_exceeded", param="input")
    return token_lists


def floats(data: bytes) -> array.array:
    """A worker's vector (float32, little-endian) as this machine's floats."""
    values = array.array("f", data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def _vector(data: bytes, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(data).decode("ascii")
    return floats(data).tolist()


def answer_json(body: EmbeddingRequest, answer: worker_pb2.EmbedResponse, prompt_tokens: int) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": _vector(vector, body.encoding_format)}
            for i, vector in enumerate(answer.embeddings)]
    return json.dumps({"object": "list", "data": data, "model": body.model,
                       "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}},
                      separators=(",", ":")).encode()


class Embeddings:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def vectors(self, body: EmbeddingRequest, principal: Principal) -> tuple[str, worker_pb2.EmbedResponse, int]:
        """The request's id, the replica's answer and the inputs' tokens: the path REST and gRPC share."""
        inference = self.ctx.inference
        model = inference.served(principal, body.model, "embedding")
        check_dimensions(body, model)
        inputs = body.inputs
        text_chars = sum(len(t) for t in inputs) if isinstance(inputs[0], str) else 0
        token_lists = await _run(text_chars > OFF_LOOP_TEXT_CHARS, lambda: tokenize(model, inputs))
        prepared = await inference.prepare_embedding(principal, model, token_lists)
        answer = await inference.embed(prepared)  # settles the request, answered or not
        self.ctx.metrics.tokens.labels(model.name, "prompt").inc(prepared.prompt_tokens)
        return prepared.request_id, answer, prepared.prompt_tokens

    async def create(self, body: EmbeddingRequest, principal: Principal) -> Response:
        _, answer, prompt_tokens = await self.vectors(body, principal)
        floats = len(answer.embeddings) * answer.dimensions
        content = await _run(floats > OFF_LOOP_FLOATS, lambda: answer_json(body, answer, prompt_tokens))
        return Response(content, media_type="application/json")
