"""Attention over the paged KV cache: `PagedAttention`, the op an attention layer calls.

On the CPU, in float32, decodes run in a C kernel that reads each sequence's KV blocks where they
lie in the cache (worker/native; 3x faster than gather + SDPA at ~140 tokens of context). On CUDA,
decodes run in a Triton kernel that does the same (gpu_attention.py): a decode step copies no
context and launches the same kernels whatever the lengths (what a CUDA graph needs). The portable
path gathers each sequence's blocks into a contiguous view and runs PyTorch's
scaled_dot_product_attention: it works on any device, and serves prefill over a cached prefix.
Decodes are batched into one SDPA call there (the query heads of a KV group are laid out as a short
query axis, so grouped-query attention needs no repeat). Prefill chunks that start a sequence
(nothing cached yet) and have similar lengths run as one padded SDPA call with a causal,
per-sequence mask: a burst of short prompts (many clients each sending a few dozen tokens) would
otherwise cost a handful of kernel launches per sequence per layer. Chunks that continue a cached
sequence, and long ones, run one sequence each. Which decode kernel runs is chosen once per layer,
device and dtype (`choose_decode`), where the layer first decodes.

Sliding-window layers (Gemma, Mistral, Phi-3) pass `window`: a query at position p sees keys at
positions p - window < k <= p, the rule transformers applies; the masks below add that bound, and
the C decode kernel reads only each context's last `window` positions. Gemma 2's soft-capped scores
(`softcap`) run through an explicit softmax in PyTorch, since its fused attention has no such option;
the C and Triton decode kernels cap them themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inferplane.worker.ops import gpu_attention, native


@dataclass
class PrefillSegment:
    """One sequence's chunk of new tokens: rows [start, start + length) of the flat batch."""

    start: int
    length: int
    context_len: int  # tokens in the cache after this chunk, this chunk included
    block_table: torch.Tensor | None  # [num_blocks] int64; None where nothing was cached before the chunk
    key_offset: int = 0  # the position the table's first block starts at (a window layer's trimmed table)

    @property
    def is_fresh(self) -> bool:
        return self.context_len == self.length


@dataclass
class PrefillGroup:
    """Fresh prefill chunks run as one padded batch: sequence p's position i is flat row gather[p, i]."""

    gather: torch.Tensor  # [P, L] flat rows; padding positions repeat the sequence's last row
    valid: torch.Tensor  # [P, L] bool: a real position, not padding
    rows: torch.Tensor  # [sum of lengths] the real flat rows, in (sequence, position) order
    mask: torch.Tensor  # [P, 1, L, L] bool: causal, within the sequence


# A group's padded length is at most this much over its shortest member's (so padding wastes at most
# about half the work of a group), and chunks longer than the cap amortize their launches anyway.
_GROUP_LENGTH_RATIO = 1.5
_GROUP_LENGTH_SLACK = 8
_GROUP_MAX_LENGTH = 256


@dataclass
class AttentionBatch:
    """Everything one forward pass needs to find and write its KV. Decode rows come first."""

    slot_mapping: torch.Tensor  # [T] flat slot index per token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_max_len: int = 0  # the longest decode context (known on the host: no device sync per layer)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # The same step as the sliding-window layers see it, where their KV has its own pool: slots and
    # tables from each sequence's window table, tables trimmed to the blocks a window still reaches
    # (decode context lengths and masks counted from the first kept block).
    window: AttentionBatch | None = None
    # Worked out by the first layer and reused by the others (the same for every layer).
    _plan: tuple[list[PrefillGroup], list[PrefillSegment]] | None = None
    _decode_masks: dict = field(default_factory=dict)

    def decode_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """[B, 1, 1, L] additive mask: 0 inside each decode's context (its last `window` positions
        for a sliding layer), -inf elsewhere. (SDPA on the CPU takes an additive mask faster than a
        boolean one.) Built once per step for each (dtype, window) the layers ask for."""
        key = (dtype, window)
        mask = self._decode_masks.get(key)
        if mask is None:
            lens = self.decode_context_lens
            positions = torch.arange(self.decode_max_len, device=lens.device)
            outside = positions[None, :] >= lens[:, None]
            if window is not None:
                outside |= positions[None, :] <= lens[:, None] - 1 - window
            mask = torch.zeros(outside.shape, dtype=dtype, device=lens.device).masked_fill_(outside, float("-inf"))
            mask = self._decode_masks[key] = mask[:, None, None, :]
        return mask

    def prefill_plan(self, device: torch.device) -> tuple[list[PrefillGroup], list[PrefillSegment]]:
        if self._plan is None:
            self._plan = plan_prefills(self.prefills, device)
        return self._plan


def plan_prefills(prefills: list[PrefillSegment],
                  device: torch.device) -> tuple[list[PrefillGroup], list[PrefillSegment]]:
    """Splits prefill chunks into padded groups of fresh chunks and chunks that run alone."""
    alone = [s for s in prefills if not s.is_fresh or s.length > _GROUP_MAX_LENGTH]
    fresh = sorted((s for s in prefills if s.is_fresh and s.length <= _GROUP_MAX_LENGTH), key=lambda s: s.length)
    groups: list[PrefillGroup] = []
    i = 0
    while i < len(fresh):
        limit = fresh[i].length * _GROUP_LENGTH_RATIO + _GROUP_LENGTH_SLACK
        j = i + 1
        while j < len(fresh) and fresh[j].length <= limit:
            j += 1
        if j - i == 1:
            alone.append(fresh[i])
        else:
            groups.append(_group(fresh[i:j], device))
        i = j
    return groups, alone


def _group(segments: list[PrefillSegment], device: torch.device) -> PrefillGroup:
    width = segments[-1].length  # sorted by length
    positions = torch.arange(width)
    starts = torch.tensor([s.start for s in segments])[:, None]
    lengths = torch.tensor([s.length for s in segments])[:, None]
    valid = positions[None, :] < lengths
    gather = starts + torch.minimum(positions[None, :], lengths - 1)
    causal = positions[None, :] <= positions[:, None]  # [query, key]
    mask = (causal[None, :, :] & valid[:, None, :])[:, None]
    return PrefillGroup(gather=gather.to(device), valid=valid.to(device), rows=gather[valid].to(device),
                        mask=mask.to(device))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[..., blocks] table → [..., length, kv_heads, head_dim] keys or values.

    index_select copies whole blocks; advanced indexing (`cache[block_table]`) gives the same tensor
    but took 4x as long on the CPU (89 against 20 us for 16 sequences of 6 blocks)."""
    blocks = cache.index_select(0, block_table.reshape(-1))  # [prod(...) * nb, bs, h, d]
    flat = blocks.view(*block_table.shape[:-1], block_table.shape[-1] * cache.shape[1], *cache.shape[2:])
    return flat[..., :length, :, :]


def _within_window(mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """A boolean [..., queries, keys] mask further limited to keys less than `window` positions back."""
    if window is None:
        return mask
    return mask & (key_positions[None, :] > query_positions[:, None] - window)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA, or with `softcap` the explicit softmax(cap * tanh(q.k * scale / cap)) that transformers
    computes for Gemma 2 (boolean masks keep True; additive masks add)."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal, scale=scale)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=scores.device).tril(m - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


class PagedAttention:
    """One attention layer's op: its scale, sliding window (None: the whole context) and score
    soft-cap (None: none), and the decode kernel chosen once per device and dtype of the queries and
    of the cache (`choose_decode`)."""

    def __init__(self, scale: float, window: int | None = None, softcap: float | None = None):
        self.scale, self.window, self.softcap = scale, window, softcap
        self._decode: dict[tuple[torch.device, torch.dtype, torch.dtype], DecodeKernel] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        decode = None
        if batch.num_decodes:
            key = (q.device, q.dtype, k_cache.dtype)
            decode = self._decode.get(key)
            if decode is None:
                decode = self._decode[key] = choose_decode(q, k_cache)
        return paged_attention(q, k, v, k_cache, v_cache, batch, self.scale, self.window, self.softcap, decode)


# A decode kernel: (the decode rows' q [B, heads, d], k_cache, v_cache, the batch, scale, window,
# softcap) -> [B, heads, d].
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch, float, int | None, float | None],
                        torch.Tensor]


def choose_decode(q: torch.Tensor, k_cache: torch.Tensor) -> DecodeKernel:
    """The decode kernel for queries of q's device and dtype over a cache like k_cache: C where the
    kernels read them (float32 queries on the CPU), Triton where it serves them (CUDA, or its
    interpreter), else the gather + SDPA in PyTorch. The C kernel checks each call's layout (the
    queries' strides, the tables' dtype) and hands a call it does not read to the next in line."""
    kernels = native.kernels() if q.device.type == "cpu" and q.dtype == torch.float32 else None
    otherwise = _triton_decode if gpu_attention.applies(q, k_cache) else _gather_decode
    if kernels is not None and kernels.reads_kv_cache(k_cache):
        return _c_decode(kernels, otherwise)
    return otherwise


def _c_decode(kernels: native.NativeKernels, otherwise: DecodeKernel) -> DecodeKernel:
    def decode(q, k_cache, v_cache, batch, scale, window, softcap):
        tables, lens = batch.decode_block_tables, batch.decode_context_lens
        if q.stride(2) == 1 and q.stride(1) == q.shape[2] and native.decode_views_read(tables, lens):
            return kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, softcap)
        return otherwise(q, k_cache, v_cache, batch, scale, window, softcap)

    return decode


def _triton_decode(q, k_cache, v_cache, batch, scale, window, softcap):
    return gpu_attention.paged_decode_attention(q, k_cache, v_cache, batch.decode_block_tables,
                                                batch.decode_context_lens, scale, window, softcap)


def _gather_decode(q, k_cache, v_cache, batch, scale, window, softcap):
    """Each decode's blocks gathered into a contiguous copy, then one SDPA call for all of them
    (the query heads of a KV group laid out as a short query axis: no repeat for grouped queries)."""
    nd, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    whole_context = window is None or batch.decode_max_len <= window  # the window limits nothing yet
    max_len = batch.decode_max_len
    keys = _gather(k_cache, batch.decode_block_tables, max_len).to(q.dtype).transpose(1, 2)  # [B, kvh, L, d]
    values = _gather(v_cache, batch.decode_block_tables, max_len).to(q.dtype).transpose(1, 2)
    query = q.view(nd, kv_heads, heads // kv_heads, dim)
    mask = batch.decode_mask(q.dtype, None if whole_context else window)
    return _attend(query, keys, values, mask, False, scale, softcap).reshape(nd, heads, dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float, window: int | None = None,
                    softcap: float | None = None, decode: DecodeKernel | None = None) -> torch.Tensor:
    """q: [T, heads, d]; k, v: this step's [T, kv_heads, d] (already stored). Returns [T, heads, d].
    `decode`: the kernel for the decode rows (PagedAttention's choice; None: choose_decode's now).

    Where the cache holds a narrower dtype than q (a float16 cache under float32 compute), prefill
    attends to this step's k and v as the cache holds them, rounded, as every later step and every
    reader of a cached prefix does: a prompt computes the same whether it came in one chunk or
    several, from the prefix cache or not, or forked (n > 1)."""
    heads = q.shape[1]
    if k_cache.dtype != q.dtype and batch.prefills:
        k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    nd = batch.num_decodes
    if nd:
        decode = decode or choose_decode(q, k_cache)
        out[:nd] = decode(q[:nd], k_cache, v_cache, batch, scale, window, softcap)
    groups, alone = batch.prefill_plan(q.device)
    for g in groups:
        query, keys, values = (x[g.gather].permute(0, 2, 1, 3) for x in (q, k, v))  # [P, heads, L, d]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        mask = g.mask
        if window is not None and g.mask.shape[-1] > window:
            positions = torch.arange(g.mask.shape[-1], device=q.device)
            mask = _within_window(mask, positions, positions, window)
        res = _attend(query, keys, values, mask, False, scale, softcap)
        out[g.rows] = res.permute(0, 2, 1, 3)[g.valid]
    for seg in alone:
        rows = slice(seg.start, seg.start + seg.length)
        query = q[rows].transpose(0, 1)  # [heads, n, d]
        offset = seg.context_len - seg.length
        if seg.is_fresh and (window is None or seg.length <= window):  # nothing cached: this step's k, v
            keys, values = k[rows], v[rows]
            causal, mask = True, None
        else:
            if seg.is_fresh:
                keys, values = k[rows], v[rows]
            else:
                keys = _gather(k_cache, seg.block_table, seg.context_len - seg.key_offset).to(q.dtype)
                values = _gather(v_cache, seg.block_table, seg.context_len - seg.key_offset).to(q.dtype)
            causal = False
            qpos = torch.arange(seg.length, device=q.device) + offset
            kpos = torch.arange(seg.key_offset, seg.context_len, device=q.device)
            mask = _within_window(kpos[None, :] <= qpos[:, None], qpos, kpos, window)
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
        values = values.transpose(0, 1).repeat_interleave(group, dim=0)
        res = _attend(query, keys, values, mask, causal, scale, softcap)
        out[rows] = res.transpose(0, 1)
    return out
