"""The rotary embedding of one step's queries and keys, with the write of its keys and values into
the KV cache: one op, since two of its kernels do both in one pass.

The tables (cos and signed sin of each row's position, [T, 1, head_dim]) come from the model
(model/layers.py's Rotary: the config's scaling lives there); the sign of rotate_half lives in the
sin table, so a rotation is one roll and a fused multiply-add (`rope`).

Two entry points, for the two ways an attention layer holds its projections:
- `fused(qkv, ...)`: one [T, heads + 2 kv_heads, d] product with q and k adjacent. The C kernel
  (native `rope_store_kv`) rotates q and k in place and writes k and v to their slots, on float32
  CPU rows and a cache it reads (float32, or float16 with F16C);
- `__call__(q, k, v, ...)`: three products. The Triton kernel (gpu_kernels.rope_store) does the same
  on a CUDA device (or under Triton's interpreter).
Elsewhere PyTorch rotates (`rope`) and writes (`store_kv`). The kernel is chosen once per device and
dtype of the queries and of the cache; a call checks only the layout of its own tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferplane.worker.ops import gpu_kernels, native

Tables = tuple[torch.Tensor, torch.Tensor]
Key = tuple[torch.device, torch.dtype, torch.dtype]  # the queries' device and dtype, the cache's dtype


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by the tables of its positions (x * cos + rotate_half(x) * sin)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Each token's k and v [T, kv_heads, d] into its slot of the caches, in the caches' dtype."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class RotaryKVWrite:
    """Rotates an attention layer's queries and keys and writes its keys and values to the cache."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._fused: dict[Key, Callable] = {}
        self._split: dict[Key, Callable] = {}

    def fused(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slot_mapping: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, heads + 2 kv_heads, d] -> rotated q, rotated k, v (views of qkv where C rotated in
        place), k and v written to `slot_mapping`'s slots."""
        key = (qkv.device, qkv.dtype, k_cache.dtype)
        kernel = self._fused.get(key) or self._choose_fused(key, k_cache)
        return kernel(qkv, cos, signed_sin, slot_mapping, k_cache, v_cache)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 signed_sin: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d] -> rotated q and k (rotated in place where
        Triton ran), k and v written to `slot_mapping`'s slots."""
        key = (q.device, q.dtype, k_cache.dtype)
        kernel = self._split.get(key) or self._choose_split(key, k_cache)
        return kernel(q, k, v, cos, signed_sin, slot_mapping, k_cache, v_cache)

    def _choose_fused(self, key: Key, k_cache: torch.Tensor) -> Callable:
        device, dtype, _ = key
        kernels = native.kernels() if device.type == "cpu" and dtype == torch.float32 else None
        if kernels is not None and self.head_dim <= 512 and kernels.reads_kv_cache(k_cache):
            kernel = self._c_fused(kernels)
        else:
            kernel = self._torch_fused
        self._fused[key] = kernel
        return kernel

    def _choose_split(self, key: Key, k_cache: torch.Tensor) -> Callable:
        device, dtype, cache_dtype = key
        triton = (gpu_kernels.runs_on(device, dtype) and gpu_kernels.runs_on(k_cache.device, cache_dtype)
                  and self.head_dim % 2 == 0)
        kernel = _triton_split if triton else _torch_split
        self._split[key] = kernel
        return kernel

    def _torch_fused(self, qkv, cos, signed_sin, slot_mapping, k_cache, v_cache):
        heads, kv_heads = self.heads, self.kv_heads
        qk = rope(qkv[:, : heads + kv_heads], cos, signed_sin)  # q and k adjacent: one rotation for both
        k, v = qk[:, heads:], qkv[:, heads + kv_heads :]
        store_kv(k_cache, v_cache, k, v, slot_mapping)
        return qk[:, :heads], k, v

    def _c_fused(self, kernels: native.NativeKernels) -> Callable:
        heads, kv_heads, otherwise = self.heads, self.kv_heads, self._torch_fused

        def kernel(qkv, cos, signed_sin, slot_mapping, k_cache, v_cache):
            if not native.float32_rows(qkv, cos, signed_sin):
                return otherwise(qkv, cos, signed_sin, slot_mapping, k_cache, v_cache)
            kernels.rope_store_kv(qkv, heads, kv_heads, cos, signed_sin, slot_mapping, k_cache, v_cache)
            return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]

        return kernel


def _torch_split(q, k, v, cos, signed_sin, slot_mapping, k_cache, v_cache):
    q, k = rope(q, cos, signed_sin), rope(k, cos, signed_sin)
    store_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, k


def _triton_split(q, k, v, cos, signed_sin, slot_mapping, k_cache, v_cache):
    if not gpu_kernels.rope_store_applies(q, k, v, cos, signed_sin, k_cache, v_cache):
        return _torch_split(q, k, v, cos, signed_sin, slot_mapping, k_cache, v_cache)
    gpu_kernels.rope_store(q, k, v, cos, signed_sin, slot_mapping, k_cache, v_cache)  # q and k rotated in place
    return q, k
