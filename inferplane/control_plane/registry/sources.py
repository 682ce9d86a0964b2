"""Where a model's weights come from and what they hold: built-in aliases, server paths (confined
to the model roots), http(s)/s3 URIs fetched through the outbound policy, and pvc:// claims taken at
the registrant's word.

Registering from a server path reads the gateway's file system, so over the API it is a platform
admin's power, confined to configured roots (`confine_source`); tenants register aliases.

Registering from an `http(s)://` URI makes the gateway connect where the caller says, so it goes
through the outbound policy (`control_plane.outbound`: public addresses, plus the operator's
allow-list), and a failed fetch answers one plain message, "cannot fetch the model from <url>",
whatever went wrong: a refused connection, a timeout and an internal service's 401 would otherwise
tell apart closed, filtered and open ports. The reason goes to the gateway's log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from inferplane.api.model_resolution import BUILTIN_MODELS, BuiltinModelMissing, builtin_model_path
from inferplane.control_plane.errors import Forbidden, InvalidInput
from inferplane.control_plane.registry.weights import CorruptWeights, ModelMetadata, detect_format, inspect_model

if TYPE_CHECKING:
    from inferplane.control_plane.outbound import OutboundPolicy
    from inferplane.storage.fetch import FetchResult

log = logging.getLogger(__name__)


def alias_path(alias: str) -> Path:
    """The weights an alias names (api.model_resolution: the rule the workers resolve it by)."""
    try:
        return builtin_model_path(alias)
    except BuiltinModelMissing as exc:
        raise InvalidInput(str(exc)) from None


def _path_text(source: str | Path) -> str:
    """The path a local source names (a `file://` URI unquoted); a 400 naming `source` for a NUL
    byte, which no file name holds (the OS calls raise ValueError on it)."""
    text = str(source)
    if text.startswith("file://"):
        text = unquote(urlparse(text).path)
    if "\x00" in text:
        raise InvalidInput(f"source {str(source)!r} contains a NUL byte; a path never does", param="source")
    return text


def resolve_source(source: str | Path) -> tuple[Path, str | None]:
    """A path or an alias → (existing absolute path, alias used or None)."""
    text = str(source)
    if text in BUILTIN_MODELS:
        return alias_path(text).resolve(), text
    path = Path(_path_text(source)).expanduser()
    if not path.exists():
        raise InvalidInput(f"no such model file or folder: {path} (aliases: {', '.join(sorted(BUILTIN_MODELS))})")
    return path.resolve(), None


def confine_source(source: str, roots: Sequence[str | Path], *, platform_admin: bool) -> str:
    """What a caller of the admin API may register: aliases for anyone; server paths for a platform
    admin, and only inside `roots`: symlinks resolved first, the path's own and, for a folder, those
    of every file and folder inside it, so none leads out. A refused path gets the same answer
    whether or not it exists: the API is no oracle for the gateway's file system."""
    if source in BUILTIN_MODELS:
        return source
    if uri_scheme(source) != "file":  # fetched from object storage or a claim: no local file is read
        if not platform_admin:
            raise Forbidden("registering weights from a URI is a platform admin's operation")
        return source
    if not platform_admin:
        raise Forbidden("registering weights from a server path is a platform admin's operation; a tenant "
                        f"admin may register these aliases: {', '.join(sorted(BUILTIN_MODELS))}")
    text = _path_text(source)
    if not os.path.isabs(text):
        raise InvalidInput(f"source must be an alias or an absolute path, got {source!r}", param="source")
    path = Path(os.path.realpath(text))
    allowed = [Path(os.path.realpath(root)) for root in roots]
    where = ", ".join(map(str, allowed)) if allowed else "none are configured (--model-root)"
    if not _inside(path, allowed):
        raise Forbidden(f"source {source!r} is outside the model roots this gateway registers from: {where}")
    if path.is_dir() and (escape := _link_outside(path, allowed)) is not None:
        raise Forbidden(f"source {source!r} holds {escape.relative_to(path)}, a symlink that leads outside the "
                        f"model roots this gateway registers from: {where}")
    return str(path)


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _link_outside(folder: Path, roots: Sequence[Path]) -> Path | None:
    """The first symlink under `folder` (files and folders, hidden ones too, and inside symlinked
    folders that stay in the roots) whose target resolves outside `roots`; None if none does. A
    model folder's files are read by the registry (digest) and the workers (weights, tokenizer), so a
    link inside a confined folder must be confined too."""
    seen: set[Path] = set()
    pending = [(folder, folder)]  # (the folder as the caller sees it, where it really is)
    while pending:
        shown, real = pending.pop()
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = list(os.scandir(real))
        except OSError:
            continue  # unreadable: nothing in it can be read through it either
        for entry in entries:
            path = shown / entry.name
            if entry.is_symlink():
                target = Path(os.path.realpath(entry.path))
                if not _inside(target, roots):
                    return path
                if target.is_dir():
                    pending.append((path, target))
            elif entry.is_dir(follow_symlinks=False):
                pending.append((path, Path(entry.path)))
    return None


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


def inspect_local(path: Path, expected_sha256: str | None) -> _Inspected:
    fmt = detect_format(path)
    status, detail = "verified", None
    try:
        meta: ModelMetadata | None = inspect_model(path)
    except CorruptWeights as e:
        meta, status, detail = None, "failed", str(e)
    if meta is not None and expected_sha256 is not None and meta.sha256 != expected_sha256:
        status, detail = "failed", f"sha256 mismatch: expected {expected_sha256}, file has {meta.sha256}"
    return _Inspected(path.as_uri(), fmt, meta, status, detail)


def inspect_remote(uri: str, expected_sha256: str | None, cache_root: Path | None,
                    outbound: OutboundPolicy | None) -> _Inspected:
    """Fetches into the digest-keyed cache (fetch_remote), then reads the header as for a local
    file; the row keeps the remote URI, which workers fetch. A digest mismatch records a failed row."""
    from inferplane.storage.fetch import DigestMismatch

    try:
        fetched = fetch_remote(uri, expected_sha256, cache_root, outbound, what="model")
    except DigestMismatch as e:
        return _Inspected(uri, "gguf" if not uri.endswith("/") else "hf", None, "failed", str(e))
    inspected = inspect_local(fetched.path, expected_sha256)
    return _Inspected(uri, inspected.format, inspected.meta, inspected.status, inspected.detail)


def fetch_remote(uri: str, expected_sha256: str | None, cache_root: Path | None,
                 outbound: OutboundPolicy | None, *, what: str) -> FetchResult:
    """Fetches `uri` into the digest-keyed cache, verifying against `expected_sha256` when given
    (a mismatch raises DigestMismatch); `what` ("model", "adapter") names it in errors.

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
        return fetch_model(uri, cache_root or default_cache_root(), sha256=expected_sha256,
                           http_transport=GuardedTransport(policy) if http else None)
    except DigestMismatch:
        raise
    except (FetchError, AddressNotAllowed) as e:
        log.warning("registering %s: %s", uri, e)
        if isinstance(e, AddressNotAllowed) or isinstance(e.__cause__, AddressNotAllowed):
            raise InvalidInput(f"cannot fetch the {what} from {uri}: its host is an internal address this gateway "
                               "does not connect to (allow it with --outbound-allow)") from None
        if http:
            raise InvalidInput(f"cannot fetch the {what} from {uri}") from None
        raise InvalidInput(f"cannot fetch {uri}: {e}") from None  # s3: the operator's endpoint, no port to probe
    except ValueError as e:  # a malformed URI or digest: found before any connection
        raise InvalidInput(f"cannot fetch {uri}: {e}") from None


def pvc_entry(uri: str, expected_sha256: str | None, fmt: str | None) -> _Inspected:
    """A PVC is not mounted here: its digest and format are the registrant's word, checked by every
    pod's fetch-model init container before the worker loads anything."""
    if expected_sha256 is None or fmt not in ("gguf", "hf"):
        raise InvalidInput("a pvc:// model needs --sha256 and --format gguf|hf: the control plane cannot read "
                           "the claim; each pod verifies the digest before loading")
    meta = ModelMetadata(fmt, expected_sha256, 0, None, None)
    return _Inspected(uri, fmt, meta, "registered", "on a PVC: verified by each pod before it loads")
