"""Decode steps of a CPU-quantized model in one C call per run of layers (native ip_decode_layers).

Why: each decoder layer's own fused call (rope, attention, four linears, norms) cost tens of
microseconds of Python and ctypes argument handling per step, about a third of SmolLM2's batch-1
step on the CPU. Here the pointers to every layer's weights and KV cache are packed into one C
array once; a step then costs one call, whatever the number of layers.

Invariants:
- A plan's pointers are valid while the model's modules and tensors are the objects it was built
  from and the KV cache is the same tensor. Reassigning an attribute of a layer's modules bumps
  `structure.version()` (WatchedModule); a plan built at another version, or for another cache, is
  rebuilt before use. Changes in place (smoothing scales, loading a checkpoint) keep the pointers.
- Which layers fuse depends on the row count: a linear whose float crossover (Int8Dispatch) is at
  or below it runs as float32 GEMM, so its layer runs op by op. The runs of fusable layers per row
  count are cached under the dispatchers' versions, which every threshold change bumps.
- The C code runs the same kernels in the same order as the layers' Python: the same bits.
"""

from __future__ import annotations

import torch

from inferplane.api.model_config import FULL, SLIDING, ModelConfig
from inferplane.worker import native
from inferplane.worker.attention import AttentionBatch, PagedKVCache
from inferplane.worker.model import structure

Segment = tuple[int, int, object]  # (first layer, end, ctypes array of LayerWeights or None: op by op)


class FusedDecode:
    """The fused-decode plan of one model (LlamaForCausalLM owns one)."""

    def __init__(self, config: ModelConfig, body: torch.nn.Module):
        self.config = config
        self.body = body  # its `layers`, read at each build (a reassigned list bumps the version)
        self.layers: torch.nn.ModuleList | None = None
        self.builds = 0  # plans built: one per model and cache unless the structure changes
        self._key: tuple | None = None
        self._linears: list[tuple] = []  # per layer: its four linears, or None where one has no kernel
        self._weights: list = []  # per layer: native.LayerWeights or None
        self._keep: list[torch.Tensor] = []  # what the pointers point into
        self._segments: dict[tuple, list[Segment]] = {}
        self._dispatches: list = []

    def _build(self, cache: PagedKVCache, key: tuple) -> None:
        self._key, self._segments, self._keep = key, {}, []
        self._linears, self._weights, dispatches = [], [], {}
        self.builds += 1
        self.layers = self.body.layers
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            operands = [lin.fused_operands() if hasattr(lin, "fused_operands") else None for lin in linears]
            # norm1 and norm2 always; Gemma's: the query/key norms and the sandwich's other two
            extra = [getattr(getattr(owner, name, None), "weight", None) for owner, name in (
                (attn, "q_norm"), (attn, "k_norm"), (layer, "pre_feedforward_layernorm"),
                (layer, "post_feedforward_layernorm"))]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     *(w for w in extra if w is not None)]
            k_cache, v_cache = cache.layer(attn.layer_index)
            if any(o is None for o in operands) or attn.head_dim > 512 or not native.float32_rows(*norms):
                self._linears.append(None)
                self._weights.append(None)
                continue
            for lin in linears:
                dispatches[id(lin.dispatch)] = lin.dispatch
            entry = native.LayerWeights()
            entry.norm1, entry.norm2 = norms[0].data_ptr(), norms[1].data_ptr()
            entry.q_norm, entry.k_norm, entry.norm3, entry.norm4 = (None if w is None else w.data_ptr() for w in extra)
            entry.window = attn.window or 0
            entry.softcap = attn.softcap or 0.0
            entry.view = int(cache.is_windowed(attn.layer_index))
            entry.rope = int(layer.rope_kind == SLIDING)
            for i, (weight, scale, bias) in enumerate(operands):
                entry.w[i] = weight.data_ptr()
                entry.s[i] = None if scale is None else scale.data_ptr()
                entry.bits[i] = linears[i].bits if scale is None else 0  # a BlockLinear's blocks
                entry.bias[i] = None if bias is None else bias.data_ptr()
                self._keep.extend(t for t in (weight, scale, bias) if t is not None)
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            self._keep.extend((*norms, k_cache, v_cache))
            self._linears.append(linears)
            self._weights.append(entry)
        self._dispatches = list(dispatches.values())

    def _segments_for(self, rows: int) -> list[Segment]:
        key = (rows, *(d.version for d in self._dispatches))
        found = self._segments.get(key)
        if found is None:
            fusable = [linears is not None and all(rows < lin.float_rows() for lin in linears)
                       for linears in self._linears]
            found, start = [], 0
            for i in range(1, len(fusable) + 1):
                if i == len(fusable) or fusable[i] != fusable[start]:
                    weights = None
                    if fusable[start]:
                        weights = (native.LayerWeights * (i - start))(*self._weights[start:i])
                    found.append((start, i, weights))
                    start = i
            self._segments[key] = found
        return found

    def forward(self, x: torch.Tensor, rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
                cache: PagedKVCache, batch: AttentionBatch) -> torch.Tensor | None:
        """x after every decoder layer, fused runs in C and the rest op by op; None where the step
        is not decode rows only or the C kernels do not apply (the caller then runs every layer).
        `rope_tables`: by rope kind (FULL, and SLIDING where the sliding layers have their own)."""
        rows = x.shape[0]
        kernels = native.kernels()
        pools = [(cache.data, batch)]
        if cache.window_data is not None:
            pools.append((cache.window_data, batch.window))
        if (batch.num_decodes != rows or batch.prefills or x.dim() != 2 or kernels is None
                or not kernels.has_int8_linear or not native.float32_rows(x, *(t for ts in rope_tables.values()
                                                                                 for t in ts))
                # x stands in for q: what is checked is the caches' and the tables' dtypes and layout
                or not all(view is not None and kernels.decode_attention_applies(
                    x.view(rows, 1, -1), data, view.decode_block_tables, view.decode_context_lens)
                    for data, view in pools)):
            return None
        key = (structure.version(), id(cache), cache.data.data_ptr(),
               None if cache.window_data is None else cache.window_data.data_ptr())
        if key != self._key:
            self._build(cache, key)
        segments = self._segments_for(rows)
        if len(segments) == 1 and segments[0][2] is None:
            return None
        config = self.config
        shape = (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size)
        ropes = [rope_tables[FULL], rope_tables.get(SLIDING, rope_tables[FULL])]
        views = [(view.slot_mapping, view.decode_block_tables, view.decode_context_lens) for _, view in pools]
        views.append(views[0])  # no window pool: no layer names view 1
        for start, end, weights in segments:
            if weights is None:
                for layer in self.layers[start:end]:
                    x = layer(x, rope_tables[layer.rope_kind], cache, batch)
                continue
            x = x.contiguous()
            kernels.decode_layers(x, weights, config.rms_norm_eps, shape, ropes, views[:2], cache.block_size,
                                  config.attention_scale, kv_half=cache.data.dtype == torch.float16,
                                  gelu=config.hidden_act == "gelu_tanh")
        return x
