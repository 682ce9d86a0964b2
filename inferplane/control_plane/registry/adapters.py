"""LoRA adapters in the registry: a registry entry of kind "adapter" (format "peft"), bound to the
base model version it was checked against.

Registering reads the adapter's files once (api/lora_manifest.py, the rule every replica applies
before loading it) and the base's config (api/model_config.py, the workers' own reading), and
refuses an adapter that does not fit its base with a 400 naming what (target module, shapes, rank,
an unserved PEFT setting, a malformed weights file, a non-finite value, a pattern RE2 does not
take); nothing is recorded then. Every tensor is read once to check its values: an adapter whose
weights hold an infinity or a NaN is never recorded as verified. The row keeps the base's reference
and digest: an adapter is served only by replicas of that very base version.

Names, versions and visibility follow the models' rules (records.claim_name): adapters and models
share one namespace per tenant, a tenant's adapters are private to it, the platform's are public.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferplane.api.lora_manifest import AdapterError, BaseShape, read_manifest
from inferplane.api.model_config import ModelLoadError, read_model_config
from inferplane.api.model_resolution import ModelResolutionError, ResolvedAdapter
from inferplane.control_plane import audit
from inferplane.control_plane.auth import ALL_TENANTS, TenantScope
from inferplane.control_plane.errors import Conflict, InvalidInput, NotFound
from inferplane.control_plane.orm import Model, utcnow
from inferplane.control_plane.registry.records import (
    PLATFORM,
    SHA256_RE,
    ModelInfo,
    _find,
    _info,
    _latest,
    _visible,
    claim_name,
    resolve_model,
)
from inferplane.control_plane.registry.sources import fetch_remote, resolve_source, uri_scheme
from inferplane.storage import cache as storage_cache
from inferplane.storage.digest import digest, size_bytes

if TYPE_CHECKING:
    from inferplane.control_plane.outbound import OutboundPolicy

ADAPTER_KIND = "adapter"
ADAPTER_FORMAT = "peft"


def _base_files(base: ModelInfo, cache_root: Path | None) -> Path:
    """Where the base's weights are on this node: its file path, or the digest cache's copy of a
    fetched one. A base on a claim cannot be read here, so its adapters cannot be checked."""
    scheme = uri_scheme(base.uri)
    if scheme == "file":
        return Path(unquote(urlparse(base.uri).path))
    if scheme != "pvc" and base.sha256:
        root = cache_root or storage_cache.default_cache_root()
        name = Path(urlparse(base.uri).path.rstrip("/")).name
        hit = storage_cache.lookup(root, base.sha256, name)
        if hit is not None:
            return hit
    raise InvalidInput(f"base model {base.ref} is not readable by the control plane ({base.uri}); an adapter is "
                       "checked against its base's files at registration", param="base")


def _adapter_folder(source: str | Path, expected_sha256: str | None, cache_root: Path | None,
                    outbound: OutboundPolicy | None) -> tuple[str, Path]:
    """(the URI the row keeps, the local folder to read) for a path, file://, http(s) or s3 source."""
    scheme = uri_scheme(source)
    if scheme == "pvc":
        raise InvalidInput("an adapter on a pvc:// claim cannot be checked by the control plane; register it "
                           "from a path or an http(s)/s3 URI", param="source")
    if scheme == "file":
        path, _ = resolve_source(source)
        return path.as_uri(), path
    from inferplane.storage.fetch import DigestMismatch

    try:
        fetched = fetch_remote(str(source), expected_sha256, cache_root, outbound, what="adapter")
    except DigestMismatch as e:
        raise InvalidInput(str(e), param="sha256") from None
    return str(source), fetched.path


def register_adapter(
    session: Session,
    source: str | Path,
    *,
    actor: str,
    base: str,
    name: str | None = None,
    version: str | None = None,
    owner_tenant_id: str | None = None,
    visibility: str | None = None,
    expected_sha256: str | None = None,
    cache_root: Path | None = None,
    outbound: OutboundPolicy | None = None,
) -> ModelInfo:
    """Registers the PEFT adapter at `source` for `base` ("name" or "name:version": the latest
    verified version, or that one). A tenant's adapter may be bound to the tenant's own models or
    the platform's; a platform adapter to platform models only. Raises InvalidInput (400) naming
    what does not fit, NotFound (404) for a base the caller cannot see, ModelNotReady (409) for an
    unverified base, Conflict for a taken name or version."""
    if "\x00" in str(source):
        raise InvalidInput("source must not hold a NUL byte", param="source")
    if name is not None and "\x00" in name:
        raise InvalidInput("name must not hold a NUL byte", param="name")
    if expected_sha256 is not None:
        expected_sha256 = expected_sha256.lower()
        if not SHA256_RE.match(expected_sha256):
            raise InvalidInput("expected sha256 must be 64 hex digits", param="sha256")
    base_info = resolve_model(session, owner_tenant_id or PLATFORM, base)
    if base_info.kind == ADAPTER_KIND:
        raise InvalidInput(f"base {base_info.ref} is itself an adapter; name the model it adapts", param="base")
    if base_info.kind == "embedding":
        raise InvalidInput(f"base {base_info.ref} is an embedding model; adapters are served on generative "
                           "models", param="base")
    uri, folder = _adapter_folder(source, expected_sha256, cache_root, outbound)
    name = name or folder.name
    namespace, version, visibility = claim_name(session, name, version, owner_tenant_id, visibility)
    others = session.scalars(select(Model).where(Model.namespace == namespace, Model.name == name)).all()
    if any(row.kind != ADAPTER_KIND for row in others):
        raise Conflict(f"{name!r} is a model's name; an adapter needs a name of its own")
    try:
        manifest = read_manifest(folder, name)
        manifest.check(BaseShape.of(read_model_config(_base_files(base_info, cache_root))))
        manifest.check_values()  # last: the one step that reads every byte
    except AdapterError as e:
        raise InvalidInput(str(e), param="source") from None
    except ModelLoadError as e:
        raise InvalidInput(f"base model {base_info.ref}: {e}", param="base") from None
    sha256 = digest(folder)
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise InvalidInput(f"sha256 mismatch: expected {expected_sha256}, the adapter has {sha256}", param="sha256")
    now = utcnow()
    row = Model(
        namespace=namespace, name=name, version=version, uri=uri, format=ADAPTER_FORMAT, sha256=sha256,
        size_bytes=size_bytes(folder), architecture=base_info.architecture, kind=ADAPTER_KIND,
        context_length=base_info.context_length, base_model=base_info.ref, base_sha256=base_info.sha256,
        lora_rank=manifest.rank, status="verified", owner_tenant_id=owner_tenant_id, visibility=visibility,
        created_at=now, updated_at=now,
    )  # fmt: skip
    session.add(row)
    session.flush()
    audit.record(session, actor=actor, action="adapter.register", target=f"{name}:{version}",
                 tenant_id=owner_tenant_id, detail={"uri": uri, "base": base_info.ref, "sha256": sha256,
                                                    "rank": manifest.rank})
    return _info(row)


def list_adapters(session: Session, tenant: TenantScope = ALL_TENANTS, *,
                  base_sha256: str | None = None) -> list[ModelInfo]:
    """Verified adapters visible to `tenant` (all for ALL_TENANTS), optionally only those of one
    base version; each name's versions oldest first."""
    query = select(Model).where(Model.kind == ADAPTER_KIND, Model.status == "verified", _visible(tenant))
    if base_sha256 is not None:
        query = query.where(Model.base_sha256 == base_sha256)
    return [_info(row) for row in sorted(session.scalars(query), key=lambda r: (r.namespace, r.name, r.id))]


def resolve_adapter(session: Session, name: str, version: str | None) -> ResolvedAdapter:
    """What a deployment's `adapters: [{name, version}]` entry loads: a platform adapter (a tenant's
    private one never backs a deployment), that version or the latest verified one. Raises
    ModelResolutionError (AdapterNotFound) naming it."""
    ref = f"{name}:{version}" if version else name
    try:
        rows = [r for r in _find(session, PLATFORM, name, version) if r.kind == ADAPTER_KIND]
    except NotFound:
        rows = []
    verified = [r for r in rows if r.status == "verified"]
    if not verified:
        raise ModelResolutionError("AdapterNotFound", f"adapter {ref} is not a verified platform adapter in the "
                                   "registry")
    row = _latest(verified)
    return ResolvedAdapter(row.name, row.version, row.uri, row.sha256 or "", row.base_sha256 or "")
