"""`/v1/embeddings`: an OpenAI embeddings body in, OpenAI's list of vectors out.

The path: the model, which must be an embedding model (400 naming its kind otherwise) →
`dimensions`, which may only restate the model's own size (BERT models are not trained to be
shortened; truncating a Matryoshka model's vectors would be the place to add it) → the inputs
tokenized as the model reads them, special tokens included ([CLS] ... [SEP], as
sentence-transformers does; token-id inputs are taken as they are), each within the model's
positions (400 naming `input`: OpenAI refuses, it does not truncate) → the completions' admission
(the request charged to the key's requests per minute before tokenizing, as for completions, then
`InferenceService.prepare_embedding`: concurrency, quota, token limits) → one replica's
Embed → JSON with each vector as floats, or as base64 of its little-endian float32 bytes (what
OpenAI sends, and what its client decodes).

The gateway tokenizes, not the worker: so an over-long input is a 400 before any replica is
involved and the request's tokens are known when its reservation is made, as for completions.
Up to 2048 inputs fit in one request: tokenizing them and writing their vectors as JSON take
tens of milliseconds, done on a thread above a small size so the event loop keeps serving (the
text size is the completions' OFF_LOOP_TEXT_CHARS).
"""

from __future__ import annotations

import array
import base64
import json
import sys

from starlette.responses import Response

from inferplane.control_plane.auth import Principal
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.inference import OFF_LOOP_TEXT_CHARS, off_loop
from inferplane.control_plane.gateway.openai_types import EmbeddingRequest
from inferplane.control_plane.gateway.prompt_bound import byte_bound
from inferplane.v1 import worker_pb2

# Above this, writing the answer runs on a thread (see the module's docstring).
OFF_LOOP_FLOATS = 32 << 10


def check_dimensions(body: EmbeddingRequest, model: ServedModel) -> None:
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise InvalidInput(f"dimensions: model {model.name!r} gives {model.dimensions}-dimensional embeddings "
                           "and cannot shorten them (it is not a Matryoshka model); leave dimensions out or "
                           f"send {model.dimensions}", code="invalid_value", param="dimensions")


def tokenize(model: ServedModel, inputs: list[str] | list[list[int]], large: bool = False) -> list[list[int]]:
    """Each input's token ids, every one checked against the model's positions; a `large` text
    input that cannot fit is refused without tokenizing (prompt_bound.py: on the thread of a large
    request, where the bound is worked out the first time)."""
    if isinstance(inputs[0], str):
        bound = byte_bound(model.tokenizer) if large else None
        for i, text in enumerate(inputs):
            if bound is not None and bound.cannot_fit(text, model.max_model_len):  # type: ignore[arg-type]
                where = f"input item {i}" if len(inputs) > 1 else "the input"
                raise InvalidInput(f"This model's maximum context length is {model.max_model_len} tokens; "
                                   f"{where} has at least {bound.min_tokens(text)} tokens.",  # type: ignore[arg-type]
                                   code="context_length_exceeded", param="input")
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
        await inference.charge_request(principal)
        large = isinstance(inputs[0], str) and sum(len(t) for t in inputs) > OFF_LOOP_TEXT_CHARS  # type: ignore[misc]
        token_lists = await off_loop(large, lambda: tokenize(model, inputs, large))
        prepared = await inference.prepare_embedding(principal, model, token_lists)
        answer = await inference.embed(prepared)  # settles the request, answered or not
        self.ctx.metrics.tokens.labels(model.name, "prompt").inc(prepared.prompt_tokens)
        return prepared.request_id, answer, prepared.prompt_tokens

    async def create(self, body: EmbeddingRequest, principal: Principal) -> Response:
        _, answer, prompt_tokens = await self.vectors(body, principal)
        floats = len(answer.embeddings) * answer.dimensions
        content = await off_loop(floats > OFF_LOOP_FLOATS, lambda: answer_json(body, answer, prompt_tokens))
        return Response(content, media_type="application/json")
