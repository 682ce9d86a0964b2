"""Downloading one file over HTTP(S), resuming a partial download with a Range request.

Weights are gigabytes and node networks drop; starting over after every reset could never finish.
A resumed download is only as good as the server's promise that the file did not change, but the
digest check after the download catches a file that did (and the mismatch deletes the partial).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from inferplane.storage.errors import FetchError

if TYPE_CHECKING:
    import httpx

_CONTENT_RANGE_RE = re.compile(r"^bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)$")


def download_http(url: str, dest: Path, *, timeout: float, transport: httpx.BaseTransport | None = None) -> None:
    """Downloads `url` into the file `dest`, appending to what is there when the server answers
    `Range: bytes=<size>-` with 206, starting over when it answers 200. Raises `FetchError` on a
    non-2xx status or a transfer error (chained from the httpx error, so a caller can tell its
    kind); what arrived before an error stays in `dest` for next time. `transport`: where the
    connections go through (the control plane passes one that refuses internal addresses, for
    redirects too; None: httpx's own, and the environment's proxies)."""
    import httpx

    for _ in range(2):  # a second pass only after the partial file was found unusable and deleted
        offset = dest.stat().st_size if dest.exists() else 0
        headers = {"Accept-Encoding": "identity"}  # raw bytes: byte ranges of a compressed body don't add up
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            with httpx.Client(timeout=timeout, follow_redirects=True, transport=transport) as client, \
                    client.stream("GET", url, headers=headers) as response:
                status = response.status_code
                if status == 416 and offset:
                    if _range_total(response.headers.get("content-range")) == offset:
                        return  # the partial file is complete: the last attempt died after its last byte
                    dest.unlink()
                    continue
                if not 200 <= status < 300:
                    raise FetchError(f"fetching {url} failed: HTTP {status} {response.reason_phrase}".rstrip())
                if status == 206 and _range_start(response.headers.get("content-range")) != offset:
                    dest.unlink(missing_ok=True)
                    continue
                with dest.open("ab" if status == 206 else "wb") as f:
                    for chunk in response.iter_raw():  # as it arrives: a buffer would be lost on a drop
                        f.write(chunk)
            return
        except httpx.HTTPError as e:
            raise FetchError(f"fetching {url} failed: {type(e).__name__}: {e}") from e
    raise FetchError(f"fetching {url} failed: the server does not honour byte ranges consistently")


def _range_start(header: str | None) -> int | None:
    match = _CONTENT_RANGE_RE.match((header or "").strip())
    return int(match.group(1)) if match and match.group(1) is not None else None


def _range_total(header: str | None) -> int | None:
    match = _CONTENT_RANGE_RE.match((header or "").strip())
    return int(match.group(2)) if match and match.group(2) != "*" else None
