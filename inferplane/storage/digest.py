"""The sha256 of model weights: one file, or a Hugging Face folder as a `sha256sum`-style manifest.

This is the registry's definition of a model's digest; the fetcher verifies downloads against it and
the cache is keyed by it, so both sides must compute it the same way. Files are read in 1 MiB
chunks, so multi-gigabyte weights never sit in memory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Regular files under `folder`, excluding hidden ones (.git, .cache) that are not weights."""
    folder = Path(folder)
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def sha256_folder(folder: str | os.PathLike[str], files: list[Path] | None = None) -> str:
    """A folder's checksum: sha256 over "<sha256>  <relative path>\\n" lines in path order (the
    `sha256sum` manifest format), so one changed, added or renamed file changes it. `files` defaults
    to `folder_files(folder)`; a caller that has already listed them passes them in."""
    folder = Path(folder)
    if files is None:
        files = folder_files(folder)
    manifest = "".join(f"{sha256_file(p)}  {p.relative_to(folder).as_posix()}\n" for p in files)
    return hashlib.sha256(manifest.encode()).hexdigest()


def digest(path: str | os.PathLike[str]) -> str:
    """The digest of model weights at `path`: `sha256_folder` for a folder, else `sha256_file`."""
    path = Path(path)
    return sha256_folder(path) if path.is_dir() else sha256_file(path)


def size_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes the digest covers: the file's size, or the sum over `folder_files` for a folder."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in folder_files(path))
    return path.stat().st_size
