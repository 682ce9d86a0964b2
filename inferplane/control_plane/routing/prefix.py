"""Prefix keys: the routing-side twin of the worker's prefix-cache block hashes.

Hashes are chained block by block (``h_i = H(h_{i-1}, block_i)``) the way vLLM hashes KV blocks, so a
key identifies the whole prefix up to a block, not just that block's tokens. The cache salt is mixed
into the first block only; chaining carries it into every later hash, so two tenants with the same
prompt get unrelated keys and land on replicas independently, exactly as their KV blocks never share.

``hashlib`` is used instead of ``hash()`` because every gateway replica must compute the same key for
the same prompt (Python's ``hash`` of str is salted per process); that is what keeps affinity intact
across router replicas without any shared state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = b"inferplane-prefix-v1"


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "",
                 max_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored,
    as the KV cache cannot share it either)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    out: list[bytes] = []
    parent = _ROOT
    for i in range(n_full):
        h = hashlib.blake2b(parent, digest_size=16)
        if i == 0:
            salt = cache_salt.encode()
            h.update(struct.pack("<I", len(salt)))
            h.update(salt)
        block = token_ids[i * block_size:(i + 1) * block_size]
        h.update(struct.pack(f"<{block_size}I", *block))
        parent = h.digest()
        out.append(parent)
    return out


def prefix_key(token_ids: Sequence[int] | None, block_size: int, cache_salt: str = "",
               affinity_blocks: int = 2) -> int | None:
    """Ring key for a prompt: the chained hash of its first ``affinity_blocks`` full blocks (or of
    all full blocks when it has fewer), or ``None`` when there is no full block to be affine to.

    Fewer affinity blocks keep a conversation's turns together (they share the early blocks); more
    spread prompts that share only a system prompt. Bounded load caps the damage of choosing few.
    """
    if not token_ids:
        return None
    hashes = block_hashes(token_ids, block_size, cache_salt, max_blocks=affinity_blocks)
    if not hashes:
        return None
    return int.from_bytes(hashes[-1][:8], "big")
