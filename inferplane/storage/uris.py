"""Where model weights live, as a URI: parsed and checked once, so every later step gets parts, not text.

Accepted forms:

- `file:///abs/path` or a plain absolute path: weights already on this node.
- `pvc://claim/path`: a path inside a PersistentVolumeClaim; the operator mounts the claim and the
  worker reads the mounted path, so nothing is fetched (the path may be empty: the claim's root).
- `http://…` / `https://…`: one file (HTTP has no listing, so never a folder).
- `s3://bucket/key`: one object, or a prefix holding a Hugging Face folder. A key ending in "/" is a
  prefix; otherwise the fetcher asks the bucket (an object by that name, else objects under "key/").

Every rejection is a `ValueError` whose one-line message names the URI, so it can go straight into a
pod's termination message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import unquote, urlsplit

Scheme = Literal["file", "pvc", "http", "https", "s3"]
SCHEMES: tuple[str, ...] = ("file", "pvc", "http", "https", "s3")
# Kubernetes object names (RFC 1123 subdomain) and S3 bucket names (the rules common to all providers).
_CLAIM_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class ModelURI:
    """A parsed model URI. Only the fields of its scheme are set: `path` (file; pvc, inside the
    claim), `claim` (pvc), `url` (http, https), `bucket` and `key` (s3)."""

    scheme: Scheme
    text: str  # as given, for messages
    path: str | None = None
    claim: str | None = None
    url: str | None = None
    bucket: str | None = None
    key: str | None = None

    @property
    def basename(self) -> str:
        """The last path component: the cached file's name, so a cached GGUF keeps its name and suffix."""
        if self.scheme == "file":
            return PurePosixPath(self.path or "/").name
        if self.scheme == "pvc":
            return PurePosixPath(self.path).name if self.path else (self.claim or "")
        if self.scheme in ("http", "https"):
            return _last_component(unquote(urlsplit(self.url or "").path))
        return _last_component(self.key or "")

    @property
    def is_prefix(self) -> bool:
        """An s3 key ending in "/": certainly a folder. False does not rule a folder out (see module doc)."""
        return self.scheme == "s3" and (self.key or "").endswith("/")

    def __str__(self) -> str:
        return self.text


def _last_component(path: str) -> str:
    return next((part for part in reversed(path.split("/")) if part), "")


def _invalid(text: str, reason: str) -> ValueError:
    return ValueError(f"invalid model URI {text!r}: {reason}")


def parse_model_uri(text: str) -> ModelURI:
    """`text` → `ModelURI`; `ValueError` naming the URI and the reason for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise _invalid(str(text), "empty")
    if text != text.strip() or any(ord(c) < 32 or ord(c) == 127 for c in text):  # a NUL ends a C path
        raise _invalid(text, "contains whitespace at its ends or control characters")
    if "://" not in text:
        if text.startswith("/"):
            return ModelURI("file", text, path=os.path.normpath(text))
        raise _invalid(text, f"expected an absolute path or a URI with one of the schemes {', '.join(SCHEMES)}")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise _invalid(text, f"unsupported scheme {parts.scheme!r} (supported: {', '.join(SCHEMES)})")
    if scheme == "file":
        return _parse_file(text, parts)
    if scheme in ("http", "https"):
        return _parse_http(text, parts, scheme)
    if parts.query or parts.fragment:
        raise _invalid(text, "a query or fragment has no meaning here")
    if scheme == "pvc":
        return _parse_pvc(text, parts)
    return _parse_s3(text, parts)


def _parse_file(text: str, parts) -> ModelURI:
    if parts.netloc not in ("", "localhost"):
        raise _invalid(text, f"a file URI names a path on this node, not on host {parts.netloc!r}")
    if parts.query or parts.fragment:
        raise _invalid(text, "a query or fragment has no meaning here")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise _invalid(text, "the path is not absolute")
    return ModelURI("file", text, path=os.path.normpath(path))


def _parse_http(text: str, parts, scheme: Scheme) -> ModelURI:
    if not parts.hostname:
        raise _invalid(text, "no host")
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        raise _invalid(text, "the port is not a number") from None
    if parts.fragment:
        raise _invalid(text, "a fragment has no meaning here")
    uri = ModelURI(scheme, text, url=text)
    if not uri.basename:
        raise _invalid(text, "the URL names no file (http(s) URIs point at a single file)")
    return uri


def _parse_pvc(text: str, parts) -> ModelURI:
    claim = parts.netloc
    if not _CLAIM_RE.match(claim):
        raise _invalid(text, f"{claim!r} is not a valid PersistentVolumeClaim name")
    path = parts.path.strip("/")
    # The worker takes the path literally, but whatever decodes it on the way (a URL library) must not
    # find an escape either: '%2e%2e' and '%2f..%2f' are refused as '..' is.
    if any(part in ("..", ".") for form in (path, unquote(path)) for part in form.split("/")):
        raise _invalid(text, "the path inside the claim may not contain '.' or '..'")
    return ModelURI("pvc", text, claim=claim, path=path)


def _parse_s3(text: str, parts) -> ModelURI:
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise _invalid(text, f"{bucket!r} is not a valid bucket name")
    key = parts.path[1:]  # keys are taken literally: no percent-decoding, as the AWS CLI does
    if not key.strip("/"):
        raise _invalid(text, "no key (s3://bucket/key names an object or a prefix, not a whole bucket)")
    if any(part in ("..", ".") for part in key.rstrip("/").split("/")):
        raise _invalid(text, "the key may not contain '.' or '..' components")
    return ModelURI("s3", text, bucket=bucket, key=key)
