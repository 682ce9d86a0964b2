"""Decode attention on the GPU that reads each sequence's KV blocks where they lie in the pool.

The portable path (attention.py) gathers every decode sequence's blocks into a contiguous copy and
runs SDPA: per layer, a copy of the whole batch's context, written and read again. This Triton
kernel reads keys and values through the block table instead, one program per (sequence, KV
head), holding the query heads of that KV group together (grouped-query attention reads each key
once), with an online softmax in float32 over tiles of `_TILE` positions. A tile need not line up
with the pool's blocks: each position finds its block through the table (`table[pos // block_size]`),
so any block size works.

Invariants the callers keep (ModelRunner, DecodeGraphs):
- the cache is [blocks, block_size, kv_heads, head_dim], contiguous; query heads h of KV head
  h // group (the layout transformers' repeat_interleave gives);
- `context_lens[i] >= 1` and `block_tables[i]` covers positions [0, context_lens[i]); entries past
  that are never read, so a padded table row may hold anything;
- nothing is read from the host during a launch (lengths come from the device tensor), so a CUDA
  graph can replay it with other lengths and tables in the same buffers.

Sliding windows (`window`) read only positions p - window < k <= p of the last query position; Gemma
2's soft-cap (`softcap`) bends each score as transformers does: cap * tanh(score / cap).

Triton is PyTorch's own dependency on Linux CUDA wheels; `TRITON_INTERPRET=1` runs the same kernel on
CPU tensors (the tests do, where there is no GPU).
"""

from __future__ import annotations

import functools

import torch

from inferplane.worker.ops import gpu_kernels

_TILE = 64  # positions per loop step


@functools.cache
def _triton():
    """The triton module and the kernels (callers check `applies` first: Triton is installed)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_acc_ptr, part_stats_ptr,
                            scale, softcap, window, splits,
                            stride_qt, stride_qh, stride_kslot, stride_kh, stride_tb, stride_ot, stride_oh,
                            BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                            USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                            SPLIT: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, TILE)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        low = 0
        if USE_WINDOW:
            low = tl.maximum(length - window, 0)
        first = (low // TILE) * TILE
        end = length
        if SPLIT:  # this program's share of the tiles; a share past the end is empty
            per_part = tl.cdiv(tl.cdiv(length - first, TILE), splits) * TILE
            first = first + part * per_part
            end = tl.minimum(first + per_part, length)
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(first, end, TILE):
            pos = start + t
            valid = (pos < end) & (pos >= low)
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
            where = slot[:, None] * stride_kslot + kv_head * stride_kh + d[None, :]
            both = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + where, mask=both, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + where, mask=both, other=0.0).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if USE_SOFTCAP:  # cap * tanh(s / cap), tanh written with exp (portable to the interpreter)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(valid[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            alpha = tl.exp(best - new_best)
            p = tl.exp(s - new_best[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
        if SPLIT:  # unscaled sums and each head's (max, sum): merge_kernel weighs the parts
            row = (seq * tl.num_programs(1) * GROUP + heads) * splits + part  # [B, heads, splits] order
            tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
            tl.store(part_stats_ptr + row * 2, best, mask=g_ok)
            tl.store(part_stats_ptr + row * 2 + 1, total, mask=g_ok)
        else:
            out = acc / total[:, None]
            tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def merge_kernel(out_ptr, part_acc_ptr, part_stats_ptr, splits, stride_ot, stride_oh,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        p = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        p_ok = p < splits
        row = (seq * tl.num_programs(1) + head) * splits + p
        best = tl.load(part_stats_ptr + row * 2, mask=p_ok, other=float("-inf"))
        total = tl.load(part_stats_ptr + row * 2 + 1, mask=p_ok, other=0.0)
        top = tl.max(best, axis=0)
        weight = tl.where(p_ok & (total > 0), tl.exp(best - top), 0.0)  # an empty part weighs nothing
        acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=p_ok[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)

    return triton, paged_decode_kernel, merge_kernel


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this decode: a CUDA device (or Triton's interpreter, for tests),
    a dtype it reads, a contiguous pool and a head size of at most 256."""
    return q.dtype in gpu_kernels.DTYPES and q.shape[-1] <= 256 and gpu_kernels.serves(k_cache)


def _splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Parts each (sequence, KV head) splits its context into: enough programs to fill the GPU's
    multiprocessors when the batch alone does not (batch 1 of a 4-KV-head model is 4 programs
    on 132 multiprocessors), at most 16. Decided by the shapes alone, so a graph keeps it."""
    if device.type != "cuda":
        return 1
    programs = rows * kv_heads
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, -(-processors // programs)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """q [B, heads, d] (one position per sequence, already rotated) → [B, heads, d] in q's dtype.

    Keys and values come from the pool in its dtype and are multiplied in q's (a float16 pool under
    float32 compute is widened as the portable path widens it). `splits` > 1 splits each context
    into that many parts, run side by side and merged (flash-decoding); default: `_splits`."""
    triton, kernel, merge = _triton()
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if rows == 0:
        return out
    q = q.contiguous()
    splits = splits or _splits(rows, kv_heads, q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    if splits > 1:
        part_acc = torch.empty(rows, heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_stats = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_stats = out  # not read: SPLIT is off
    kernel[(rows, kv_heads, splits)](
        out, q, k_cache, v_cache, block_tables, context_lens, part_acc, part_stats, float(scale),
        float(softcap or 1.0), int(window or 0), splits,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK_D=block_d, TILE=_TILE, USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32, SPLIT=splits > 1)
    if splits > 1:
        merge[(rows, heads)](out, part_acc, part_stats, splits, out.stride(0), out.stride(1),
                             HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out
