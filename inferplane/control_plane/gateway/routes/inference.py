"""The OpenAI-compatible tenant API: the model list, completions, chat completions and embeddings.

Paths and bodies follow OpenAI's so the official `openai` client works unchanged against
`http://host:port/v1`. The three POST routes are documented here and served, in the running gateway,
by the fast path in front of FastAPI (fast_path.py), which calls the same `Completions` and
`Embeddings` methods; these routes still answer when the app runs without the fast path.
(`inference.py` one level up is the service behind them: admission, routing, the worker streams.)
"""

from __future__ import annotations

from fastapi import APIRouter

from inferplane.control_plane.auth import SCOPE_MODELS_READ
from inferplane.control_plane.gateway.completions import Completions
from inferplane.control_plane.gateway.embeddings import Embeddings
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from inferplane.control_plane.gateway.routes.dependencies import Context, TenantCaller

router = APIRouter()

# With "stream": true the same operation answers with server-sent events; the schema describes
# one event (each `data` is a JSON chunk, an error object, or the final "[DONE]").
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_STREAMABLE: dict[int | str, dict] = {200: {"description": "the completion (JSON), or with stream=true its chunks "
                                                            "as server-sent events",
                                            "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def _model_card(m) -> dict:
    card = {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owner_tenant or m.owned_by}
    if m.parent is not None:  # a LoRA adapter: the served model it runs on (vLLM's field)
        card["parent"] = m.parent
    return card


@router.get("/v1/models")
async def list_models(ctx: Context, principal: TenantCaller):
    principal.require(SCOPE_MODELS_READ)
    return {"object": "list", "data": [_model_card(m) for m in ctx.catalog.visible(principal.tenant_id)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, ctx: Context, principal: TenantCaller):
    principal.require(SCOPE_MODELS_READ)
    return _model_card(ctx.catalog.get(model_id, principal.tenant_id))


@router.post("/v1/completions", responses=_STREAMABLE)
async def completions(body: CompletionRequest, ctx: Context, principal: TenantCaller):
    return await Completions(ctx).text(body, principal)


@router.post("/v1/chat/completions", responses=_STREAMABLE)
async def chat_completions(body: ChatCompletionRequest, ctx: Context, principal: TenantCaller):
    return await Completions(ctx).chat(body, principal)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, ctx: Context, principal: TenantCaller):
    """OpenAI's embeddings, from a model deployed with kind: embedding."""
    return await Embeddings(ctx).create(body, principal)
