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


@dataclass(frozen=True)
class AdapterRecord:
    """A verified LoRA adapter of the registry, as the gateway serves it: under its name, to its
    owner's keys (None: every tenant's), through a served model whose weights are its base."""

    name: str
    owner_tenant: str | None
    uri: str
    sha256: str
    base_sha256: str
    created: int


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
    # The registry digests of the weights its deployments serve: what LoRA adapters bind to.
    weights_sha256: frozenset[str] = frozenset()
    # A LoRA adapter served through its base: the base's served name (the route) and the adapter.
    parent: str | None = None
    adapter: AdapterRecord | None = None

    def visible_to(self, tenant_id: str | None) -> bool:
        return tenant_id is None or self.owner_tenant is None or self.owner_tenant == tenant_id

    @property
    def route_name(self) -> str:
        """The served model whose replicas answer: the base for an adapter, else this one."""
        return self.parent or self.name

    @classmethod
    def from_info(cls, name: str, info, **settings) -> ServedModel:
        """A served model as a replica's worker.proto InfoResponse describes it (tokenizer, context,
        kind from its architecture, vector size); `settings` are the deployment's (isolation, band)."""
        kind = model_kind(info.architecture) or "generate"  # an architecture not listed is a generator
        return cls(name=name, tokenizer=TextTokenizer.from_wire(info), max_model_len=info.max_model_len,
                   kind=kind, dimensions=info.embedding_dimensions or None, **settings)


class Catalog:
    """Thread-safe map of served model name → ServedModel; the supervisor or operator sync fills it.

    LoRA adapters (`set_adapters`, from the registry) are served under their own names through the
    served model whose weights are their base; each is visible to its owner's keys only (a public
    one to all). A served model's name takes precedence over an adapter of the same name, and an
    adapter whose base is not served (yet) is not listed: it answers 404 like an unknown name.
    """

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self._adapters: dict[tuple[str | None, str], AdapterRecord] = {}  # (owner, name) -> record
        # (owner, name) -> the adapter as served now (None: its base is not served): built when the
        # models or adapters change, so that requests only look entries up
        self._served: dict[tuple[str | None, str], ServedModel | None] = {}
        self._lock = threading.Lock()

    def put(self, model: ServedModel) -> None:
        with self._lock:
            self._models[model.name] = model
            self._serve_adapters()

    def remove(self, name: str) -> None:
        with self._lock:
            self._models.pop(name, None)
            self._serve_adapters()

    def set_adapters(self, records: list[AdapterRecord]) -> None:
        """Replaces the adapters the catalog knows (the registry's verified ones; for a name with
        several versions, the last in `records` wins)."""
        with self._lock:
            self._adapters = {(r.owner_tenant, r.name): r for r in records}
            self._serve_adapters()

    def _serve_adapters(self) -> None:  # under the lock
        self._served = {key: self._served_adapter(record) for key, record in self._adapters.items()}

    def _served_adapter(self, record: AdapterRecord) -> ServedModel | None:
        """The adapter as a served model, through the first served model (by name) of its base."""
        bases = sorted((m for m in self._models.values() if record.base_sha256 in m.weights_sha256
                        and m.kind == "generate"), key=lambda m: m.name)
        if not bases or record.name in self._models:
            return None
        base = bases[0]
        return ServedModel(name=record.name, tokenizer=base.tokenizer, max_model_len=base.max_model_len,
                           owner_tenant=record.owner_tenant, cache_isolation=base.cache_isolation,
                           priority=base.priority, created=record.created, owned_by=base.owned_by,
                           parent=base.name, adapter=record)

    def visible(self, tenant_id: str | None) -> list[ServedModel]:
        """What `tenant_id` may call, each name once: the entry `get` answers for it (a served model
        over any adapter; the tenant's own adapter over a public one of the same name, which a
        tenant keeps when the platform registers that name after it; nothing where that adapter's
        base is not served). Sorted by name."""
        def precedence(key: tuple[str | None, str]) -> tuple[int, str]:
            owner = key[0]
            return (0 if owner == tenant_id else 1 if owner is None else 2), owner or ""

        with self._lock:
            found = {m.name: m for m in self._models.values() if m.visible_to(tenant_id)}
            decided = set(self._models)
            for key in sorted(self._served, key=precedence):
                owner, name = key
                if name in decided or not (tenant_id is None or owner in (None, tenant_id)):
                    continue
                decided.add(name)
                if (served := self._served[key]) is not None:
                    found[name] = served
        return sorted(found.values(), key=lambda m: m.name)

    def get(self, name: str, tenant_id: str | None) -> ServedModel:
        """Another tenant's private model or adapter answers exactly like a missing one: 404."""
        with self._lock:
            model = self._models.get(name)
            if model is None:
                key = (tenant_id, name) if (tenant_id, name) in self._adapters else (None, name)
                if key not in self._adapters and tenant_id is None:  # the platform admin sees every tenant's
                    key = next((k for k in self._adapters if k[1] == name), key)
                model = self._served.get(key)
        if model is None or not model.visible_to(tenant_id):
            raise ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.")
        return model
