"""Decode attention over a paged pool written out one sequence and one head at a time: the oracle
for the Triton kernel (tests/worker/test_gpu_attention.py on the CPU, test_cuda.py on a GPU)."""

from __future__ import annotations

import math

import torch

# (heads, kv_heads, head_dim, block_size, pool dtype, query dtype, window, softcap)
CASES = [
    (4, 2, 16, 16, torch.float32, torch.float32, None, None),
    (8, 2, 64, 16, torch.float32, torch.float32, 20, None),
    (6, 6, 40, 8, torch.float32, torch.float32, None, 5.0),
    (32, 4, 64, 16, torch.float32, torch.float32, None, None),
    (4, 1, 16, 5, torch.float16, torch.float32, 7, 3.0),
]
GPU_CASES = [
    (32, 4, 64, 16, torch.bfloat16, torch.bfloat16, None, None),
    (16, 8, 128, 16, torch.float16, torch.float16, 100, 50.0),
]
LENGTHS = [1, 37, 100, 64]
SPLITS = [None, 1, 3, 16]  # None: the kernel's own choice for the device


def reference(q, k_cache, v_cache, tables, lens, scale, window, softcap) -> torch.Tensor:
    rows, heads, dim = q.shape
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(rows):
        length = int(lens[i])
        low = max(0, length - window) if window else 0
        pos = torch.arange(low, length, device=q.device)
        slots = tables[i][pos // block] * block + pos % block
        keys = k_cache.reshape(-1, kv_heads, dim)[slots].float()
        values = v_cache.reshape(-1, kv_heads, dim)[slots].float()
        for h in range(heads):
            scores = keys[:, h // group] @ q[i, h].float() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[i, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def check_cases(device: str, cases=CASES) -> float:
    """Runs the kernel on every case; raises on a difference past the case's tolerance, returns
    the largest difference seen (relative to the output's scale)."""
    from inferplane.worker.ops import gpu_attention

    torch.manual_seed(0)
    worst = 0.0
    for heads, kv_heads, dim, block, pool_dtype, q_dtype, window, softcap in cases:
        blocks = 40
        k_cache = torch.randn(blocks, block, kv_heads, dim, device=device).to(pool_dtype)
        v_cache = torch.randn(blocks, block, kv_heads, dim, device=device).to(pool_dtype)
        lens = torch.tensor(LENGTHS, device=device)
        tables = torch.stack([torch.randperm(blocks, device=device)[:30] for _ in LENGTHS])
        q = torch.randn(len(LENGTHS), heads, dim, device=device).to(q_dtype)
        scale = 1 / math.sqrt(dim)
        expected = reference(q, k_cache, v_cache, tables, lens, scale, window, softcap)
        for splits in SPLITS:  # one pass, and contexts split in parts (some empty: length 1) merged
            got = gpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, softcap,
                                                       splits=splits)
            assert got.dtype == q.dtype and got.shape == q.shape
            error = (got.float() - expected).abs().max().item()
            tolerance = 1e-5 if q_dtype == torch.float32 else 2e-2
            case = (heads, kv_heads, dim, block, pool_dtype, q_dtype, window, softcap, splits)
            assert error <= tolerance, f"{case}: max difference {error}"
            worst = max(worst, error)
    return worst
