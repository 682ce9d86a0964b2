"""Served models as the gateway knows them: a name tenants call, who may see it, and what the
gateway needs to prepare a request for it (tokenizer, context length) before routing.

The gateway tokenizes once, so it can refuse a too-long prompt with a 400 before any worker is
involved, and hash the prompt's leading blocks for prefix-affinity routing. A served model's kind
(generate or embedding, api/architectures.py) says which endpoints take it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from inferplane.api.architectures import ModelKind, model_kind
from inferplane.api.tokenizer import TextTokenizer
from inferplane.control_plane.errors import ModelNotFound


@dataclass
class ServedModel:
    name: str
    tokenizer: TextTokenizer
    max_model_len: int
    owner_tenant: str | None = None  # None: every tenant may use it
    cache_isolation: str = "tenant"  # "tenant": per-tenant radix namespaces; "shared": one
    priority: str | None = None  # the band its requests get when neither key nor tenant sets one
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "inferplane"
    kind: ModelKind = "generate"  # "embedding": /v1/embeddings only; "generate": chat and completions only
    dimensions: int | None = None  # an embedding model's vector size

    def visible_to(self, tenant_id: str | None) -> bool:
        return tenant_id is None or self.owner_tenant is None or self.owner_tenant == tenant_id

    @classmethod
    def from_info(cls, name: str, info, **settings) -> ServedModel:
        """A served model as a replica's worker.proto InfoResponse describes it (tokenizer, context,
        kind from its architecture, vector size); `settings` are the deployment's (isolation, band)."""
        kind = model_kind(info.architecture) or "generate"  # an architecture not listed is a generator
        return cls(name=name, tokenizer=TextTokenizer.from_wire(info), max_model_len=info.max_model_len,
                   kind=kind, dimensions=info.embedding_dimensions or None, **settings)


class Catalog:
    """Thread-safe map of served model name → ServedModel; the supervisor or operator sync fills it."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()

    def put(self, model: ServedModel) -> None:
        with self._lock:
            self._models[model.name] = model

    def remove(self, name: str) -> None:
        with self._lock:
            self._models.pop(name, None)

    def visible(self, tenant_id: str | None) -> list[ServedModel]:
        with self._lock:
            return sorted((m for m in self._models.values() if m.visible_to(tenant_id)), key=lambda m: m.name)

    def get(self, name: str, tenant_id: str | None) -> ServedModel:
        """Another tenant's private model answers exactly like a missing one: 404."""
        with self._lock:
            model = self._models.get(name)
        if model is None or not model.visible_to(tenant_id):
            raise ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.")
        return model
