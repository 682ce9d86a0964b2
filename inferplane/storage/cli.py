"""`inferplane fetch-model`: the init container that puts a model's weights into the node cache.

It prints the path to load on stdout (so `$(inferplane fetch-model …)` is the path) and a one-line
timing summary on stderr. A failure exits 1 with one line on stderr, and the same line goes to the
termination log, which Kubernetes shows as the container's termination message in the pod status:
`kubectl describe pod` then says "digest mismatch for s3://…" rather than just "Init:Error".
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uri", required=True, help="file:// (or absolute path), http(s)://, or s3://bucket/key[/]")
    parser.add_argument("--sha256", required=True, help="the digest the registry recorded (64 hex digits)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the node's model cache (default: $INFERPLANE_MODEL_CACHE or ~/.cache/inferplane/models)")
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="an S3-compatible store (default: $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per network wait (default: %(default)s)")
    parser.add_argument("--termination-log", type=Path, default=None,
                        help=f"where a failure's message goes too (default: {DEFAULT_TERMINATION_LOG} if writable)")


def run(args: argparse.Namespace) -> int:
    from inferplane.storage.cache import default_cache_root
    from inferplane.storage.errors import FetchError
    from inferplane.storage.fetch import fetch_model

    try:
        result = fetch_model(args.uri, args.cache_dir or default_cache_root(), sha256=args.sha256,
                             s3_endpoint_url=args.s3_endpoint_url, timeout=args.timeout)
    except (FetchError, ValueError, OSError) as e:
        line = " ".join(f"error: {e}".split())  # one line, whatever the exception carried
        print(line, file=sys.stderr)
        _write_termination_log(args.termination_log, line)
        return 1
    print(result.path)
    print(summary(result.size_bytes, downloaded=result.downloaded, fetch_seconds=result.fetch_seconds,
                  verify_seconds=result.verify_seconds), file=sys.stderr)
    return 0


def summary(size: int, *, downloaded: bool, fetch_seconds: float, verify_seconds: float) -> str:
    """`fetched 12.3 MiB in 0.41 s, verified in 0.05 s`, or `cached: 12.3 MiB, nothing fetched`."""
    mib = f"{size / (1 << 20):.1f} MiB"
    if downloaded:
        return f"fetched {mib} in {fetch_seconds:.2f} s, verified in {verify_seconds:.2f} s"
    if verify_seconds:
        return f"local: {mib} verified in place in {verify_seconds:.2f} s"
    return f"cached: {mib}, nothing fetched"


def _write_termination_log(path: Path | None, line: str) -> None:
    """Best effort: the termination log is a courtesy; failing to write it must not hide the error."""
    if path is None:
        if not os.access(DEFAULT_TERMINATION_LOG, os.W_OK):
            return
        path = Path(DEFAULT_TERMINATION_LOG)
    try:
        path.write_text(line + "\n")
    except OSError:
        pass
