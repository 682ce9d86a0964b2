"""Paged attention's batched prefill groups give what one-sequence-at-a-time attention gives."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferplane.worker.ops.attention import AttentionBatch, PrefillSegment, paged_attention, plan_prefills
from inferplane.worker.ops.kv_cache import PagedKVCache


def _reference(q, k, v, segments, group: int, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for s in segments:
        rows = slice(s.start, s.start + s.length)
        keys = k[rows].transpose(0, 1).repeat_interleave(group, dim=0)
        values = v[rows].transpose(0, 1).repeat_interleave(group, dim=0)
        out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, is_causal=True,
                                                   scale=scale).transpose(0, 1)
    return out


def test_fresh_prefills_of_mixed_lengths_match_per_sequence_attention():
    torch.manual_seed(0)
    lengths = [1, 2, 3, 5, 9, 10, 12, 17, 30, 31, 40, 300]  # several groups, a lone one and an over-cap one
    heads, kv_heads, dim = 6, 2, 16
    total = sum(lengths)
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    segments, start = [], 0
    for n in lengths:
        segments.append(PrefillSegment(start=start, length=n, context_len=n, block_table=None))
        start += n
    order = [5, 0, 11, 3, 8, 1, 10, 2, 6, 4, 9, 7]  # batch order need not be sorted by length
    batch = AttentionBatch(slot_mapping=torch.zeros(total, dtype=torch.long), prefills=[segments[i] for i in order])
    groups, alone = plan_prefills(batch.prefills, torch.device("cpu"))
    assert len(groups) >= 3 and sum(len(g.gather) for g in groups) + len(alone) == len(lengths)
    assert any(s.length == 300 for s in alone)
    cache = PagedKVCache(1, 1, 4, kv_heads, dim, torch.float32, torch.device("cpu"))
    k_cache, v_cache = cache.layer(0)
    ours = paged_attention(q, k, v, k_cache, v_cache, batch, scale=dim**-0.5)
    expected = _reference(q, k, v, segments, heads // kv_heads, scale=dim**-0.5)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
