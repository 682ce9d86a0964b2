"""Prefix keys: a prompt's KV block names as the gateway computes them, equal to the workers' own.

Blocks are named by `api/kv_blocks.py`'s chained hash (``h_i = H(h_{i-1}, block_i)``, as vLLM names
KV blocks), starting from the request's namespace (the tenant's cache salt, and the adapter under a
LoRA adapter): a name identifies the whole prefix up to its block, and two tenants with the same
prompt get unrelated names, exactly as their KV blocks never share. The workers publish the names of
the blocks they hold under the same scheme (KV events), so the gateway's index can look a prompt's
blocks up without tokens crossing the wire twice.

The hash is ``hashlib``'s, not ``hash()``: every gateway replica must compute the same key for the
same prompt (Python's ``hash`` of str is salted per process); that keeps affinity intact across
gateway replicas without any shared state.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferplane.api.kv_blocks import chain_keys, kv_namespace


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "",
                 max_blocks: int | None = None, adapter_key: str = "") -> list[bytes]:
    """The chained names of the full blocks of ``token_ids`` (a trailing partial block is ignored,
    as the KV cache cannot share it either), at most ``max_blocks`` of them."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    end = len(token_ids) if max_blocks is None else min(len(token_ids), max_blocks * block_size)
    return chain_keys(kv_namespace(cache_salt, adapter_key), token_ids[:end], block_size)


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
