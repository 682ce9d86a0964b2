"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step is a few hundred small kernels (norms, rotations, projections, attention, per layer).
Launched one by one from Python, each costs about 10 us of host time (10.5 us measured on an H200)
against under 1 us replayed from a graph, so at small and medium batches the host, not the GPU,
set a decode step's pace. DecodeGraphs captures the model's decode forward, embedding to logits,
once per bucket over static input buffers; a step copies its inputs into those buffers and replays.

Invariants:
- Only decode-shaped steps replay: every scheduled sequence computes exactly one token, and the
  rows fit the largest bucket. Prefill and mixed steps run eagerly (ModelRunner decides).
- A step's rows are padded up to the bucket: padding rows are token 0 at position 0, write their
  KV to the cache's scratch block (PagedKVCache.scratch) and attend to that one slot, so they never
  touch a sequence's KV; their outputs are never read.
- Every bucket's graph reads the same buffers, and attention reads lengths and block tables from
  the device (gpu_attention.py), so one capture serves every context length up to max_model_len.
- The graphs share one memory pool, captured largest first so the smaller reuse its blocks; the
  Engine counts the largest bucket's activations out of the KV budget before sizing the pool
  (`activation_bytes`).
"""

from __future__ import annotations

import torch

from inferplane.worker.engine.kv.block_pool import blocks_for
from inferplane.worker.ops.attention import AttentionBatch
from inferplane.worker.ops.kv_cache import PagedKVCache


def buckets(max_rows: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 16, and max_rows itself (a
    batch pads to the next one: at most 15 rows of padding past 16)."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_rows} | set(range(16, max_rows, 16)) | {max_rows}
    return sorted(sizes)


class _TableBuffers:
    """Static slots, block tables and context lengths of one pool (the main one or the window one)."""

    def __init__(self, rows: int, width: int, scratch: int, block_size: int, device: torch.device):
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.lens = torch.ones(rows, dtype=torch.long, device=device)
        self.scratch = scratch
        self.block_size = block_size
        self.pad(0, rows)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: one token in the scratch block."""
        if end > start:
            self.slots[start:end] = self.scratch * self.block_size
            self.tables[start:end, 0] = self.scratch
            self.lens[start:end] = 1

    def load(self, batch: AttentionBatch, rows: int) -> None:
        width = batch.decode_block_tables.shape[1]
        if width > self.tables.shape[1]:
            raise ValueError(f"decode graphs: a block table of {width} blocks, captured for {self.tables.shape[1]}")
        self.slots[:rows].copy_(batch.slot_mapping)
        self.tables[:rows, :width].copy_(batch.decode_block_tables)
        self.lens[:rows].copy_(batch.decode_context_lens)

    def batch(self, rows: int) -> AttentionBatch:
        # decode_max_len bounds what the portable (gathering) attention would read: the whole table
        return AttentionBatch(slot_mapping=self.slots[:rows], num_decodes=rows,
                              decode_block_tables=self.tables[:rows], decode_context_lens=self.lens[:rows],
                              decode_max_len=self.tables.shape[1] * self.block_size)


class DecodeGraphs:
    """The decode forward of `model` over `cache`, captured per bucket of up to `max_rows` rows.

    `capture=False` runs the same padded static-buffer forward eagerly instead of replaying (the
    CPU tests check the padding and the buffers with it; there is no CUDA there)."""

    def __init__(self, model, cache: PagedKVCache, max_rows: int, max_model_len: int, window: int | None,
                 capture: bool = True):
        if cache.scratch is None:
            raise ValueError("decode graphs need a KV cache with a scratch block for the padding rows")
        device = cache.data.device
        bs = cache.block_size
        self.model = model
        self.cache = cache
        self.sizes = buckets(max_rows)
        rows = self.sizes[-1]
        width = blocks_for(max_model_len, bs)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.main = _TableBuffers(rows, width, cache.scratch, bs, device)
        self.windowed = None
        if window is not None:  # a window table reaches at most the window's blocks plus the partial ones
            self.windowed = _TableBuffers(rows, min(width, blocks_for(window, bs) + 3), cache.window_scratch, bs,
                                          device)
        self.captured = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.replays = 0
        if capture:
            self._capture()

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def _forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.main.batch(rows)
        if self.windowed is not None:
            batch.window = self.windowed.batch(rows)
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], self.cache, batch)
        return hidden, self.model.compute_logits(hidden)

    def _pad(self, start: int, end: int) -> None:
        if end > start:
            self.input_ids[start:end] = 0
            self.positions[start:end] = 0
        for buffers in (self.main, self.windowed):
            if buffers is not None:
                buffers.pad(start, end)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # every row is padding until a step loads its own: what capture runs touches only the scratch block
        for rows in reversed(self.sizes):
            # warm-up on a side stream, outside the capture: Triton compiles, cuBLAS picks its kernels
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, logits = self._forward(rows)
            self.graphs[rows] = (graph, hidden, logits)
        torch.cuda.synchronize()

    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, logits) of a decode-only step's rows, in the graph's output buffers: read them
        before the next step replays."""
        rows = batch.num_decodes
        size = next(s for s in self.sizes if s >= rows)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.main.load(batch, rows)
        if self.windowed is not None:
            self.windowed.load(batch.window, rows)
        self._pad(rows, size)
        self.replays += 1
        if not self.captured:
            hidden, logits = self._forward(size)
            return hidden[:rows], logits[:rows]
        graph, hidden, logits = self.graphs[size]
        graph.replay()
        return hidden[:rows], logits[:rows]


@torch.inference_mode()
def activation_bytes(model, cache_shape: dict, rows: int) -> int:
    """Device memory a decode forward of `rows` rows takes beyond the weights: what the graphs'
    pool will hold. Measured on a one-block cache (with the same layers windowed) before the real
    pool is sized; `cache_shape` holds PagedKVCache's arguments but the block counts."""
    device = torch.device(cache_shape["device"])
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = PagedKVCache(num_blocks=1, num_window_blocks=1, scratch_block=True, **cache_shape)
    window = 1 if cache.window_layers else None
    probe = DecodeGraphs(model, cache, rows, cache.block_size, window, capture=False)
    probe._forward(probe.max_rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del probe, cache
    torch.cuda.empty_cache()
    return max(0, peak)
