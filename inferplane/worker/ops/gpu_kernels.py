"""The decoder block's small steps as one Triton kernel each on the GPU: RMSNorm (with the residual
add before it), the rotary embedding of queries and keys with the KV write, and SwiGLU's SiLU-times-up.

In PyTorch ops these are about 25 kernels a layer (an RMSNorm alone is eight: cast, square, mean,
add, rsqrt, multiply, cast, multiply). Each costs a launch and a pass over memory; at batch 1 the
launches, not the bytes, set the time (even replayed from a CUDA graph, where a launch still costs
about 1-2 us of device time). Fused, they are three or four kernels a layer.

Each kernel rounds where the PyTorch ops it replaces round (to the tensors' dtype after the same
steps), so the GPU path computes what the ops' PyTorch paths (norm.py, rope.py, activation.py)
compute, only in fewer passes:
- RMSNorm: x in float32, times rsqrt(mean(x^2) + eps), rounded to x's dtype, times the weight;
  with a residual, x + delta is rounded to x's dtype first (and written back: the running sum);
- rotation: x * cos rounded, then + roll(x, d/2) * signed sin in one rounding (torch.addcmul);
- SiLU: silu(gate) rounded, times up, rounded.

`runs_on()` and `serves()` say where they run: CUDA tensors, or any tensor under Triton's interpreter
(TRITON_INTERPRET=1, how the CPU tests run them).
"""

from __future__ import annotations

import functools
import os

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels read


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) rather than compiling them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these kernels can serve tensors of this device and dtype, layout aside: what an op
    asks once, where it chooses its backend (`serves` checks the tensors themselves)."""
    return dtype in DTYPES and (device.type == "cuda" or interpreting()) and triton_installed()


def serves(*tensors: torch.Tensor) -> bool:
    """Whether these kernels serve these tensors: contiguous, of a dtype they read, on a CUDA device
    (or under the interpreter), with Triton installed."""
    return (all(t.is_contiguous() and t.dtype in DTYPES and (t.device.type == "cuda" or interpreting())
                for t in tensors) and triton_installed())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(out_ptr, x_ptr, delta_ptr, w_ptr, eps, columns,
                        ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < columns
        x = tl.load(x_ptr + row * columns + c, mask=ok, other=0.0)
        if ADD:
            delta = tl.load(delta_ptr + row * columns + c, mask=ok, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(x_ptr + row * columns + c, x, mask=ok)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / columns + eps)
        normed = (h * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * columns + c, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def silu_mul_kernel(out_ptr, gate_ptr, up_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        g = tl.load(gate_ptr + i, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + i, mask=ok, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
        tl.store(out_ptr + i, (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                          BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        c = tl.arange(0, BLOCK)
        ok = c < HALF
        dim = 2 * HALF
        cos1 = tl.load(cos_ptr + token * dim + c, mask=ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + token * dim + HALF + c, mask=ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + token * dim + c, mask=ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + token * dim + HALF + c, mask=ok, other=0.0).to(tl.float32)
        if head < HEADS:
            row = q_ptr + (token * HEADS + head) * dim
        else:
            row = k_ptr + (token * KV_HEADS + head - HEADS) * dim
        x1 = tl.load(row + c, mask=ok, other=0.0)
        x2 = tl.load(row + HALF + c, mask=ok, other=0.0)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        # x * cos rounded (its own op in PyTorch), then one rounding of + roll(x) * signed sin (addcmul)
        y1 = ((f1 * cos1).to(x1.dtype).to(tl.float32) + f2 * sin1).to(x1.dtype)
        y2 = ((f2 * cos2).to(x1.dtype).to(tl.float32) + f1 * sin2).to(x1.dtype)
        tl.store(row + c, y1, mask=ok)
        tl.store(row + HALF + c, y2, mask=ok)
        if head >= HEADS:  # a key: it and its value go to the token's slot in the cache
            kv_head = head - HEADS
            slot = tl.load(slots_ptr + token).to(tl.int64)
            target = (slot * KV_HEADS + kv_head) * dim
            tl.store(k_cache_ptr + target + c, y1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(k_cache_ptr + target + HALF + c, y2.to(k_cache_ptr.dtype.element_ty), mask=ok)
            source = v_ptr + (token * KV_HEADS + kv_head) * dim
            v1 = tl.load(source + c, mask=ok, other=0.0)
            v2 = tl.load(source + HALF + c, mask=ok, other=0.0)
            tl.store(v_cache_ptr + target + c, v1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_cache_ptr + target + HALF + c, v2.to(v_cache_ptr.dtype.element_ty), mask=ok)

    return triton, rms_norm_kernel, silu_mul_kernel, rope_store_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x's rows [rows, columns]; with `delta`, of x + delta, which is also written into x."""
    triton, kernel, _, _ = _kernels()
    rows, columns = x.shape
    out = torch.empty_like(x)
    if rows:
        kernel[(rows,)](out, x, delta if delta is not None else x, weight, float(eps), columns,
                        ADD=delta is not None, BLOCK=triton.next_power_of_2(columns))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise."""
    _, _, kernel, _ = _kernels()
    out = torch.empty_like(up)
    n = up.numel()
    block = 1024
    if n:
        kernel[(-(-n // block),)](out, gate, up, n, BLOCK=block)
    return out


def rope_store_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return serves(q, k, v, cos, sin, k_cache, v_cache) and q.shape[-1] % 2 == 0 and q.dtype == cos.dtype


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Rotates q [T, heads, d] and k [T, kv_heads, d] in place by their positions' tables (cos and
    signed sin, [T, 1, d]) and writes each token's k and v to its slot of the cache."""
    triton, _, _, kernel = _kernels()
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if tokens:
        kernel[(tokens, heads + kv_heads)](q, k, v, cos, sin, slot_mapping, k_cache, v_cache, HEADS=heads,
                                           KV_HEADS=kv_heads, HALF=dim // 2,
                                           BLOCK=triton.next_power_of_2(dim // 2))
