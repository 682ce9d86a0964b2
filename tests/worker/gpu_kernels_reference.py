"""The fused GPU kernels (worker/ops/gpu_kernels.py) against the PyTorch ops they replace (the ops'
path where no kernel serves), on whatever device the caller names: the CPU under Triton's
interpreter (tests/worker/test_gpu_attention.py) or a GPU (tests/worker/test_cuda.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferplane.worker.ops.rope import rope


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def check_kernels(device: str) -> dict[str, float]:
    """Largest difference of each kernel from the PyTorch ops, in units of the dtype's epsilon at
    the output's scale; raises where one is past 2 such units."""
    from inferplane.worker.ops import gpu_kernels

    torch.manual_seed(0)
    worst: dict[str, float] = {}

    def compare(name: str, got: torch.Tensor, expected: torch.Tensor, coarser: torch.dtype | None = None) -> None:
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        eps = max(torch.finfo(expected.dtype).eps, torch.finfo(coarser or expected.dtype).eps)
        scale = expected.float().abs().max().item() * eps
        units = (got.float() - expected.float()).abs().max().item() / scale
        assert units <= 2, f"{name}: {units:.2f} epsilons off"
        worst[name] = max(worst.get(name, 0.0), units)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, columns in ((1, 64), (7, 576), (3, 100)):
            x = torch.randn(rows, columns, device=device).to(dtype)
            delta = torch.randn(rows, columns, device=device).to(dtype)
            weight = (1 + 0.3 * torch.randn(columns, device=device)).to(dtype)
            compare(f"rms_norm {dtype}", gpu_kernels.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
            summed = x.clone()
            normed = gpu_kernels.rms_norm(summed, weight, 1e-6, delta=delta)
            compare(f"residual add {dtype}", summed, x + delta)
            compare(f"rms_norm after add {dtype}", normed, torch_rms_norm(x + delta, weight, 1e-6))
            gate = torch.randn(rows, columns, device=device).to(dtype)
            compare(f"silu_mul {dtype}", gpu_kernels.silu_mul(gate, x), F.silu(gate) * x)
        for tokens, heads, kv_heads, dim in ((1, 4, 2, 16), (5, 8, 2, 64), (3, 6, 6, 40)):
            q = torch.randn(tokens, heads, dim, device=device).to(dtype)
            k = torch.randn(tokens, kv_heads, dim, device=device).to(dtype)
            v = torch.randn(tokens, kv_heads, dim, device=device).to(dtype)
            angles = torch.randn(tokens, 1, dim // 2, device=device)
            cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
            sin = (torch.cat([-angles.sin(), angles.sin()], dim=-1)).to(dtype)
            for cache_dtype in {dtype, torch.float16}:
                k_cache = torch.zeros(4, 4, kv_heads, dim, device=device, dtype=cache_dtype)
                v_cache = torch.zeros_like(k_cache)
                slots = torch.randperm(16, device=device)[:tokens]
                expected_q, expected_k = rope(q, cos, sin), rope(k, cos, sin)
                got_q, got_k = q.clone(), k.clone()
                gpu_kernels.rope_store(got_q, got_k, v, cos, sin, slots, k_cache, v_cache)
                compare(f"rope q {dtype}", got_q, expected_q)
                compare(f"rope k {dtype}", got_k, expected_k)
                compare(f"k stored {dtype}->{cache_dtype}", k_cache.view(-1, kv_heads, dim)[slots],
                        expected_k.to(cache_dtype), coarser=dtype)
                assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v.to(cache_dtype))
                assert k_cache.view(-1, kv_heads, dim).abs().sum() > 0
    return worst
