"""A KV block's name: a chained hash, as vLLM's prefix cache names its blocks. The workers name
their blocks with it (tiers, KV events) and the gateway names a prompt's blocks with it (its index of
what each replica holds, its hash ring), so both sides must compute it here, the one place.

Block i's key hashes block i-1's key and block i's tokens, so a key stands for the whole prefix up
to the block's end: equal keys mean equal tokens from the first one, which is what makes the KV
reusable. The chain starts from the namespace (the tenant's cache salt and the adapter; see
`RadixKV.namespace`), so the same tokens under another tenant or adapter get other keys: a tenant
can neither read nor probe another tenant's blocks by name.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from enum import StrEnum

KEY_BYTES = 16  # 128-bit names: collisions are out of reach at any cache size


class Medium(StrEnum):
    """Where a worker holds a block's KV, as its KV events say (the proto's `medium`): its own pool
    (GPU memory, or host memory on the CPU runtimes), its host-memory tier, or its disk tier. vLLM's
    `medium` names the device; ours name the worker's store, since the pool may be host memory too."""

    POOL = "pool"
    MEMORY = "memory"
    DISK = "disk"


def adapter_cache_key(name: str, sha256: str) -> str:
    """What slots, prefix caches, KV block names and metrics tell LoRA adapters apart by: the
    adapter's name and the start of its weights' digest (its version)."""
    return f"{name}@{sha256[:16]}"


LORA_MARK = "\x00lora:"  # between a namespace's salt and its adapter's key


def kv_namespace(cache_salt: str, adapter_key: str) -> str:
    """The namespace a request's prefixes are matched in and its keys start from: its cache salt
    (decided by the gateway, per tenant), and under a LoRA adapter the adapter too, since the same
    tokens give other KV there (`RadixKV.namespace` says why the worker never widens it)."""
    return f"{cache_salt}{LORA_MARK}{adapter_key}" if adapter_key else cache_salt


def namespace_root(namespace: str) -> bytes:
    """The chain's start for a namespace (what block 0's key hashes as its parent)."""
    return hashlib.blake2b(b"inferplane-kv-namespace\x00" + namespace.encode(), digest_size=KEY_BYTES).digest()


def chain_keys(namespace: str, tokens: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """The keys of every full block of `tokens` (a partly filled last block has none: its KV is not
    final). `parent` continues a chain whose previous block's key it is; by default the chain
    starts at the namespace's root."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    previous = namespace_root(namespace) if parent is None else parent
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("q", tokens[start:start + block_size]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=KEY_BYTES).digest()
        keys.append(previous)
    return keys
