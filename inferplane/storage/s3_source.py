"""Downloading from S3 (or an S3-compatible store): one object, or every object under a prefix.

The client is built per fetch from the usual AWS environment (credentials, region, endpoint), with
path-style addressing so a store on a loopback or in-cluster address (MinIO, moto) works without
DNS for "<bucket>.<host>". Each object is resumed from its partial file with a ranged GetObject.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from inferplane.storage import cache
from inferplane.storage.errors import FetchError
from inferplane.storage.uris import ModelURI

DEFAULT_REGION = "us-east-1"
_MISSING = {"404", "NoSuchKey", "NotFound"}


def s3_client(endpoint_url: str | None, *, timeout: float) -> Any:
    """An S3 client: `endpoint_url`, else $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL, else AWS.
    A new session each time: boto3's default session is not safe to share between threads."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
    config = Config(s3={"addressing_style": "path"}, connect_timeout=timeout, read_timeout=timeout,
                    retries={"mode": "standard", "max_attempts": 3})
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=config)


def download_s3(uri: ModelURI, partial: Path, *, endpoint_url: str | None, timeout: float) -> Path:
    """Downloads `uri` into `partial`: an object to `partial/<basename>`, a prefix to
    `partial/model/<path relative to the prefix>`. Returns that file or folder. Raises `FetchError`
    (naming the URI) for anything the store or the network says no to."""
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError as Urllib3Error

    try:
        client = s3_client(endpoint_url, timeout=timeout)
        size = None if uri.is_prefix else _object_size(client, uri.bucket, uri.key)
        if size is not None:
            cache.keep_only(partial, uri.basename)
            _download_object(client, uri.bucket, uri.key, size, partial / uri.basename)
            return partial / uri.basename
        prefix = uri.key if uri.is_prefix else f"{uri.key}/"
        plan = _list_folder(client, uri, prefix)
        folder = partial / cache.FOLDER_NAME
        cache.keep_only(partial, cache.FOLDER_NAME)
        folder.mkdir(exist_ok=True)
        _remove_unplanned(folder, {rel for _, rel, _ in plan})
        for key, rel, obj_size in plan:
            dest = folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            _download_object(client, uri.bucket, key, obj_size, dest)
        return folder
    except ClientError as e:
        error = e.response.get("Error", {})
        raise FetchError(f"fetching {uri} failed: S3 {error.get('Code', '?')}: {error.get('Message', e)}") from e
    except (BotoCoreError, Urllib3Error) as e:
        raise FetchError(f"fetching {uri} failed: {type(e).__name__}: {e}") from e


def _object_size(client: Any, bucket: str, key: str) -> int | None:
    """The object's size, or None when there is no object by that name (then it may be a prefix)."""
    from botocore.exceptions import ClientError

    try:
        return int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    except ClientError as e:
        if str(e.response.get("Error", {}).get("Code")) in _MISSING:
            return None
        raise


def _list_folder(client: Any, uri: ModelURI, prefix: str) -> list[tuple[str, str, int]]:
    """(key, relative path, size) of every object under `prefix`. Directory markers (keys ending in
    "/") are skipped, and so are hidden files (.gitattributes, .cache/…): the folder digest does not
    cover them, and nothing unverified goes into the cache."""
    plan = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel or rel.endswith("/"):
                continue
            parts = rel.split("/")
            if any(part in ("", ".", "..") for part in parts):
                raise FetchError(f"fetching {uri} failed: object key {obj['Key']!r} is not a safe relative path")
            if any(part.startswith(".") for part in parts):
                continue
            plan.append((obj["Key"], rel, int(obj["Size"])))
    if not plan:
        raise FetchError(f"fetching {uri} failed: no object named {uri.key!r} and no objects under {prefix!r}")
    return plan


def _remove_unplanned(folder: Path, planned: set[str]) -> None:
    """Partial files of objects no longer listed would end up in the folder (and its digest)."""
    for path in sorted(folder.rglob("*"), reverse=True):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in planned:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def _download_object(client: Any, bucket: str, key: str, size: int, dest: Path) -> None:
    """Downloads one object into `dest`, resuming from its current size (a ranged GetObject)."""
    offset = dest.stat().st_size if dest.exists() else 0
    if offset > size:
        dest.unlink()
        offset = 0
    if offset == size and dest.exists():
        return
    extra = {"Range": f"bytes={offset}-"} if offset else {}
    body = client.get_object(Bucket=bucket, Key=key, **extra)["Body"]
    try:
        with dest.open("ab" if offset else "wb") as f:
            for chunk in body.iter_chunks(1 << 18):  # small: a drop loses at most one chunk
                f.write(chunk)
    finally:
        body.close()
    if dest.stat().st_size != size:
        raise FetchError(f"fetching s3://{bucket}/{key} failed: got {dest.stat().st_size} of {size} bytes")
