"""The model registry: register weights from a path, verify them, and answer who may see what.

This module keeps the records: (name, version) rows, who may see and change them, and what a
deployment runs (sources.py says where weights come from, weights.py reads them).

Visibility: a model with no owner is a platform model and public. A tenant's model is private (only
that tenant sees it); public names are the platform's. Names live in namespaces: "" (`PLATFORM`)
for platform models, the tenant id for a tenant's, so a tenant can neither take a platform name
nor slip a version under someone else's. A tenant looking a name up finds its own model first,
then the platform's; deployments look names up in the platform's namespace only. Every
tenant-facing function takes the caller's tenant id (or `ALL_TENANTS` for a platform admin) and
filters in SQL; another tenant's private model is reported as not found, never as forbidden, so its
existence does not leak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from inferplane.api.architectures import model_kind
from inferplane.api.model_resolution import ModelResolutionError, ResolvedModel, model_ref_text
from inferplane.control_plane import audit
from inferplane.control_plane.auth import ALL_TENANTS, TenantScope
from inferplane.control_plane.errors import Conflict, Forbidden, InvalidInput, NotFound
from inferplane.control_plane.orm import Model, Tenant, utcnow
from inferplane.control_plane.registry.sources import (
    inspect_local,
    inspect_remote,
    pvc_entry,
    resolve_source,
    uri_scheme,
)
from inferplane.control_plane.registry.weights import inspect_model
from inferplane.storage.uris import parse_model_uri

if TYPE_CHECKING:
    from inferplane.control_plane.outbound import OutboundPolicy
    from inferplane.control_plane.registry.sources import _Inspected

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# Names that are admin API paths under /admin/v1/models/ (GET .../resolve), not model references.
RESERVED_NAMES = frozenset({"resolve"})
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
PLATFORM = ""  # the platform's namespace (no tenant id is empty)


class ModelNotReady(Conflict):
    """409: the model exists but is not `verified`, so it cannot be served."""

    code = "model_not_ready"


@dataclass(frozen=True)
class ModelInfo:
    id: int
    name: str
    version: str
    uri: str
    format: str
    sha256: str | None
    size_bytes: int | None
    architecture: str | None
    kind: str | None  # "generate" | "embedding"; None when the architecture is unknown (a pvc:// entry)
    context_length: int | None
    status: str
    status_detail: str | None
    owner_tenant_id: str | None
    visibility: str
    created_at: datetime
    updated_at: datetime
    base_model: str | None = None  # an adapter's base ("name:version"); None for a model
    base_sha256: str | None = None  # that base version's digest
    lora_rank: int | None = None
    chat_template: bool | None = None  # the tokenizer has one (a chat model); None: not read

    @property
    def path(self) -> Path:
        return Path(unquote(urlparse(self.uri).path))

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"


def _kind(row: Model) -> str | None:
    return row.kind or model_kind(row.architecture)  # rows from before kinds were recorded


def _info(row: Model) -> ModelInfo:
    return ModelInfo(
        row.id, row.name, row.version, row.uri, row.format, row.sha256, row.size_bytes, row.architecture,
        _kind(row), row.context_length, row.status, row.status_detail, row.owner_tenant_id, row.visibility,
        row.created_at, row.updated_at, row.base_model, row.base_sha256, row.lora_rank, row.chat_template,
    )  # fmt: skip


def parse_ref(ref: str) -> tuple[str, str | None]:
    """ "name" or "name:version" → (name, version or None)."""
    name, _, version = ref.partition(":")
    if not NAME_RE.match(name) or (version and not VERSION_RE.match(version)):
        raise InvalidInput(f"invalid model reference {ref!r}: expected <name> or <name>:<version>")
    return name, version or None


def _visible(tenant: TenantScope) -> Any:
    if tenant is ALL_TENANTS:
        return True
    return or_(Model.visibility == "public", Model.owner_tenant_id == tenant)


def is_visible(model: ModelInfo, tenant: TenantScope) -> bool:
    """The rule `_visible` applies in SQL, for a gateway filtering a cached model list in memory."""
    return tenant is ALL_TENANTS or model.visibility == "public" or model.owner_tenant_id == tenant


def _version_sort_key(row: Model) -> tuple[int, int | str, int]:
    """Numeric versions compare as numbers ("10" after "9"); others by registration order."""
    return (1, int(row.version), row.id) if row.version.isdigit() else (0, row.id, row.id)


def _latest(rows: list[Model]) -> Model:
    return max(rows, key=lambda r: r.id)


def _next_version(session: Session, namespace: str, name: str) -> str:
    versions = session.scalars(select(Model.version).where(Model.namespace == namespace, Model.name == name)).all()
    numbers = [int(v) for v in versions if v.isdigit()]
    return str(max(numbers, default=0) + 1)


def claim_name(session: Session, name: str, version: str | None, owner_tenant_id: str | None,
               visibility: str | None) -> tuple[str, str, str]:
    """(namespace, version, visibility) for a new registration of `name` (a model's or an adapter's:
    one namespace of names): checks the name, version and visibility, and that the name is the
    caller's to use; the version defaults to the next integer. Raises InvalidInput, Forbidden,
    NotFound (an unknown owner) or Conflict."""
    if not NAME_RE.match(name):
        raise InvalidInput(f"invalid model name {name!r}: letters, digits, '.', '_', '-', '/'; up to 128",
                           param="name")
    if name in RESERVED_NAMES:
        raise InvalidInput(f"model name {name!r} is reserved: /admin/v1/models/{name} is an endpoint of the "
                           "admin API, so such a model could not be deleted by name; choose another name",
                           param="name")
    if version is not None and not VERSION_RE.match(version):
        raise InvalidInput(f"invalid model version {version!r}", param="version")
    visibility = visibility or ("private" if owner_tenant_id else "public")
    if visibility not in ("public", "private"):
        raise InvalidInput(f"visibility must be public or private, got {visibility!r}")
    if owner_tenant_id is None and visibility == "private":
        raise InvalidInput("a platform model (no owner tenant) must be public")
    if owner_tenant_id is not None and visibility == "public":
        raise Forbidden("public models are the platform's; a tenant's models are private")
    if owner_tenant_id is not None and session.get(Tenant, owner_tenant_id) is None:
        raise NotFound(f"tenant {owner_tenant_id!r} not found")
    namespace = owner_tenant_id or PLATFORM
    existing = session.scalars(select(Model).where(Model.namespace == namespace, Model.name == name)).all()
    # A new tenant name may not be a platform name (a tenant's older name stays its own).
    if namespace != PLATFORM and not existing and session.scalars(
            select(Model.id).where(Model.namespace == PLATFORM, Model.name == name)).first() is not None:
        raise Conflict(f"model name {name!r} is a platform model's; choose another name")
    version = version or _next_version(session, namespace, name)
    if any(r.version == version for r in existing):
        raise Conflict(f"model {name}:{version} already exists")
    return namespace, version, visibility


def register_model(
    session: Session,
    source: str | Path,
    *,
    actor: str,
    name: str | None = None,
    version: str | None = None,
    owner_tenant_id: str | None = None,
    visibility: str | None = None,
    expected_sha256: str | None = None,
    model_format: str | None = None,
    cache_root: Path | None = None,
    outbound: OutboundPolicy | None = None,
    reuse_unchanged: bool = False,
) -> ModelInfo:
    """Registers weights at `source`: a path, `file://` URI or alias such as "smollm2-135m"; an
    `http(s)://` or `s3://` URI (fetched into the cache at `cache_root` to be checked and read); or
    `pvc://claim/path` (needs `expected_sha256` and `model_format`, see `pvc_entry`).

    Defaults: name = the alias or the file/folder name; version = next integer for that name;
    visibility = private for a tenant's model, public for a platform model. A checksum mismatch
    or unreadable metadata still records the row, with status `failed` and the reason, so the admin
    sees it in `list`; the caller checks `status`. Raises `InvalidInput` for a missing path or bad
    names, `Conflict` if the version exists or the name belongs to another owner. `outbound`: where
    an http(s) source may be fetched from besides public addresses (None: nowhere else).
    `reuse_unchanged` (no `version` given): when the latest version of `name` has the same URI and
    its weights read the same (digest, status), that version is returned and nothing is recorded;
    `inferplane up` registers its manifests' weights on every start, and a restart is no new model.
    """
    if expected_sha256 is not None:
        expected_sha256 = expected_sha256.lower()
        if not SHA256_RE.match(expected_sha256):
            raise InvalidInput("expected sha256 must be 64 hex digits", param="sha256")
    scheme = uri_scheme(source)
    if scheme == "file":
        path, alias = resolve_source(source)
        default_name = alias or (path.stem if path.is_file() else path.name)
    else:
        if scheme == "pvc":  # nothing here reads a claim, so nothing else would parse (and refuse) the URI
            try:
                parse_model_uri(str(source))
            except ValueError as e:
                raise InvalidInput(f"source: {e}", param="source") from None
        default_name = PurePosixPath(urlparse(str(source)).path.rstrip("/")).name.removesuffix(".gguf")
    name = name or default_name
    version_given = version
    namespace, version, visibility = claim_name(session, name, version, owner_tenant_id, visibility)

    if scheme == "file":
        inspected = inspect_local(path, expected_sha256)
    elif scheme == "pvc":
        inspected = pvc_entry(str(source), expected_sha256, model_format)
    else:
        inspected = inspect_remote(str(source), expected_sha256, cache_root, outbound)
    meta = inspected.meta
    if reuse_unchanged and version_given is None:
        same = _unchanged(session, namespace, name, inspected)
        if same is not None:
            return _info(same)
    now = utcnow()
    row = Model(
        namespace=namespace,
        name=name,
        version=version,
        uri=inspected.uri,
        format=inspected.format,
        sha256=meta.sha256 if meta else None,
        size_bytes=meta.size_bytes if meta else None,
        architecture=meta.architecture if meta else None,
        kind=meta.kind if meta else None,
        context_length=meta.context_length if meta else None,
        chat_template=meta.chat_template if meta else None,
        status=inspected.status,
        status_detail=inspected.detail,
        owner_tenant_id=owner_tenant_id,
        visibility=visibility,
        created_at=now,
        updated_at=now,
    )
    session.add(row)
    session.flush()
    audit.record(
        session,
        actor=actor,
        action="model.register",
        target=f"{name}:{version}",
        tenant_id=owner_tenant_id,
        detail={"uri": row.uri, "status": row.status, "sha256": row.sha256},
    )
    return _info(row)


def _unchanged(session: Session, namespace: str, name: str, inspected: _Inspected) -> Model | None:
    """The latest version of `name` if it records what `inspected` read (URI, digest, status)."""
    rows = session.scalars(select(Model).where(Model.namespace == namespace, Model.name == name)).all()
    if not rows:
        return None
    latest = _latest(list(rows))
    sha256 = inspected.meta.sha256 if inspected.meta else None
    same = (latest.uri, latest.format, latest.sha256, latest.status, latest.status_detail) == (
        inspected.uri, inspected.format, sha256, inspected.status, inspected.detail)
    return latest if same and latest.kind != "adapter" else None


def resolve_for_deployment(session: Session, name: str, version: str | None) -> ResolvedModel:
    """What a deployment's `model: {name, version}` runs: a platform model (a tenant's private
    registration never backs a deployment), that version or the latest verified one. PVC entries
    count as servable: the pods verify them. Raises `ModelResolutionError` naming name and version."""
    ref = model_ref_text(name, version)
    try:
        rows = _find(session, PLATFORM, name, version)
    except NotFound:
        raise ModelResolutionError("ModelNotFound", f"model {ref} is not in the registry") from None
    if any(r.kind == "adapter" for r in rows):
        raise ModelResolutionError("ModelIsAdapter", f"model {ref} is a LoRA adapter of {rows[0].base_model}: deploy "
                                   "that model with engine.maxLoras > 0 and send requests to the adapter's name")
    servable = [r for r in rows if r.status == "verified" or (r.status == "registered" and r.uri.startswith("pvc://"))]
    row = _latest(servable or rows)
    if not servable or row.sha256 is None:
        raise ModelResolutionError("ModelNotVerified", f"model {row.name}@{row.version} is {row.status}"
                                   + (f": {row.status_detail}" if row.status_detail else ""))
    return ResolvedModel(row.name, row.version, row.uri, row.sha256, row.format, row.size_bytes, _kind(row))


def _find(session: Session, tenant: TenantScope, name: str, version: str | None) -> list[Model]:
    """The rows of one namespace for `name`: the tenant's own, else the platform's (`PLATFORM`: only
    the platform's). A platform admin gets the platform's, else the one tenant's that has it."""
    visible = Model.namespace == PLATFORM if tenant == PLATFORM else _visible(tenant)
    query = select(Model).where(Model.name == name, visible)
    if version is not None:
        query = query.where(Model.version == version)
    by_namespace: dict[str, list[Model]] = {}
    for row in session.scalars(query):
        by_namespace.setdefault(row.namespace, []).append(row)
    ref = f"{name}:{version}" if version else name
    if not by_namespace:
        raise NotFound(f"model {ref!r} not found")
    for namespace in ([] if tenant is ALL_TENANTS else [str(tenant)]) + [PLATFORM]:
        if namespace in by_namespace:
            return by_namespace[namespace]
    if len(by_namespace) > 1:
        raise Conflict(f"model {ref!r} is registered by several tenants ({', '.join(sorted(by_namespace))})")
    return next(iter(by_namespace.values()))


def list_models(session: Session, tenant: TenantScope, *, status: str | None = None) -> list[ModelInfo]:
    """Every version visible to `tenant` (its own, public, platform), by name then version order."""
    query = select(Model).where(_visible(tenant))
    if status is not None:
        query = query.where(Model.status == status)
    rows = list(session.scalars(query))
    rows.sort(key=lambda r: (r.name, _version_sort_key(r)))
    return [_info(r) for r in rows]


def list_versions(session: Session, tenant: TenantScope, name: str) -> list[ModelInfo]:
    rows = _find(session, tenant, name, None)
    return [_info(r) for r in sorted(rows, key=_version_sort_key)]


def get_model(session: Session, tenant: TenantScope, ref: str) -> ModelInfo:
    """`ref` is "name" (latest registered version) or "name:version"; any status."""
    name, version = parse_ref(ref)
    return _info(_latest(_find(session, tenant, name, version)))


def resolve_model(session: Session, tenant: TenantScope, ref: str) -> ModelInfo:
    """What to serve for `ref`: "name" → the latest *verified* version; "name:version" → that one,
    which must be verified. `NotFound` (404) if invisible/absent, `ModelNotReady` (409) otherwise."""
    name, version = parse_ref(ref)
    rows = _find(session, tenant, name, version)
    verified = [r for r in rows if r.status == "verified"]
    if not verified:
        row = _latest(rows)
        raise ModelNotReady(
            f"model {row.name}:{row.version} is {row.status}: {row.status_detail or ''}".rstrip(": ")
        )
    return _info(_latest(verified))


def _check_owner(rows: list[Model], tenant: TenantScope, verb: str) -> None:
    if tenant is ALL_TENANTS:
        return
    if any(r.owner_tenant_id != tenant for r in rows):
        # Visible (public) but not theirs: they know it exists, so 403 leaks nothing.
        raise Forbidden(f"only the owner can {verb} model {rows[0].name!r}")


def delete_model(session: Session, tenant: TenantScope, ref: str, *, actor: str) -> list[ModelInfo]:
    """Deletes one version ("name:version") or all versions ("name"); only the owner or a platform
    admin may. Returns what was deleted."""
    name, version = parse_ref(ref)
    rows = _find(session, tenant, name, version)
    _check_owner(rows, tenant, "delete")
    deleted = [_info(r) for r in rows]
    for row in rows:
        session.delete(row)
    session.flush()
    audit.record(
        session,
        actor=actor,
        action="model.delete",
        target=ref,
        tenant_id=rows[0].owner_tenant_id,
        detail={"versions": [d.version for d in deleted]},
    )
    return deleted


def verify_model(session: Session, tenant: TenantScope, ref: str, *, actor: str) -> ModelInfo:
    """Re-reads the weights of one version and compares with the recorded checksum (e.g. after a
    copy to new storage); sets `verified` or `failed`."""
    name, version = parse_ref(ref)
    row = _latest(_find(session, tenant, name, version))
    _check_owner([row], tenant, "verify")
    path = Path(unquote(urlparse(row.uri).path))
    if row.kind == "adapter":
        _verify_adapter(row, path)
        session.flush()
        audit.record(session, actor=actor, action="model.verify", target=f"{row.name}:{row.version}",
                     tenant_id=row.owner_tenant_id, detail={"status": row.status})
        return _info(row)
    try:
        if not path.exists():
            raise InvalidInput(f"weights are gone: {path}")
        meta = inspect_model(path, use_cache=False)
    except InvalidInput as e:
        row.status, row.status_detail = "failed", str(e)
    else:
        if row.sha256 is not None and meta.sha256 != row.sha256:
            row.status, row.status_detail = (
                "failed",
                f"sha256 changed: recorded {row.sha256}, now {meta.sha256}",
            )
        else:
            row.status, row.status_detail = "verified", None
            row.sha256, row.size_bytes = meta.sha256, meta.size_bytes
            row.architecture, row.kind, row.context_length = meta.architecture, meta.kind, meta.context_length
            row.chat_template = meta.chat_template
    row.updated_at = utcnow()
    session.flush()
    audit.record(
        session,
        actor=actor,
        action="model.verify",
        target=f"{row.name}:{row.version}",
        tenant_id=row.owner_tenant_id,
        detail={"status": row.status},
    )
    return _info(row)


def _verify_adapter(row: Model, path: Path) -> None:
    """An adapter's files compared with its recorded digest (its fit was checked at registration)."""
    from inferplane.storage.digest import digest

    if not path.exists():
        row.status, row.status_detail = "failed", f"the adapter's files are gone: {path}"
    elif (actual := digest(path)) != row.sha256:
        row.status, row.status_detail = "failed", f"sha256 changed: recorded {row.sha256}, now {actual}"
    else:
        row.status, row.status_detail = "verified", None
    row.updated_at = utcnow()
