"""What the admin API shows a tenant admin of the platform's storage.

Registry rows record where weights live (`uri`: a server path, a bucket, a claim) and why a check
failed (`status_detail`, which names those paths), and registration errors name the files they
read. A platform admin manages that storage and sees all of it. A tenant admin registers aliases
only (registry.confine_source), so a path or bucket in an answer is the platform's, never something
it supplied: it sees the alias an entry's weights come from, else the URI's scheme with the rest
redacted, and every path or URI in a detail or an error message redacted.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from inferplane.api.model_resolution import BUILTIN_MODELS, BuiltinModelMissing, builtin_model_path
from inferplane.control_plane.auth import Principal
from inferplane.control_plane.errors import ControlPlaneError

REDACTED = "(redacted)"
# A URI, or an absolute path (a '/' that starts a word), without the ':' or '.' that may end the
# sentence around it; the API's own paths (/admin/..., /v1/...) are not the server's.
_PATH_OR_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\",;)]*[^\s'\",;):.]"
                          r"|(?<![\w.~/-])/(?!(?:admin|v1|alerts)/)[^\s'\",;:)]*[^\s'\",;:).]")


def redact_paths(text: str) -> str:
    """`text` with every URI and absolute path replaced by `REDACTED`."""
    return _PATH_OR_URI.sub(REDACTED, text)


@functools.cache
def _alias_uris() -> dict[str, str]:
    """The file:// URI of each built-in alias installed here -> the alias (what a tenant admin
    registers from). Where a package lives does not change while the process runs."""
    found = {}
    for alias in BUILTIN_MODELS:
        try:
            found[builtin_model_path(alias).resolve().as_uri()] = alias
        except BuiltinModelMissing:
            continue
    return found


def shown_uri(uri: str) -> str:
    """A registry URI as a tenant admin sees it: the alias it is, else its scheme and `REDACTED`."""
    alias = _alias_uris().get(uri)
    if alias is not None:
        return alias
    scheme, sep, _ = uri.partition("://")
    return f"{scheme}://{REDACTED}" if sep else REDACTED


def registry_entry(info: Any, principal: Principal) -> dict[str, Any]:
    """A registry ModelInfo (model or adapter) as the admin API answers `principal` with it."""
    entry = dict(info.__dict__)
    if principal.tenant_id is None:
        return entry
    entry["uri"] = shown_uri(info.uri)
    if entry.get("status_detail"):
        entry["status_detail"] = redact_paths(entry["status_detail"])
    return entry


@contextmanager
def errors_redacted_for(principal: Principal) -> Iterator[None]:
    """Around registry calls: a tenant admin's error names no path or URI (its status, code and
    `param` stay); a platform admin's keeps them, as the paths are its own."""
    try:
        yield
    except ControlPlaneError as exc:
        if principal.tenant_id is not None:
            exc.args = (redact_paths(str(exc)),)
        raise
