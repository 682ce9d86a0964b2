"""Decode steps of a CPU-quantized model in one C call per run of layers (native ip_decode_layers):
the backend of a whole decoder layer, where the C kernels read every part of it.

Why: each decoder layer's own fused call (rope, attention, four linears, norms) cost tens of
microseconds of Python and ctypes argument handling per step, about a third of SmolLM2's batch-1
step on the CPU. Here the pointers to every layer's weights and KV cache are packed into one C
array once; a step then costs one call, whatever the number of layers.

What the plan reads of a model (model/llama.py owns one plan): the body's `layers` and final `norm`;
per layer its `self_attn` (qkv_proj, o_proj, q_norm and k_norm or None, layer_index, head_dim,
window, softcap), its `mlp` (gate_up_proj and down_proj, or a MoE's gate, experts, top_k and
normalize), its norms (input_layernorm, post_attention_layernorm, and Gemma's
pre/post_feedforward_layernorm where it has them) and its `rope_kind`. A layer the C call cannot run
is run as the module it is (`layer(x, tables, cache, batch)`), so a layer only has to name its parts.

Invariants:
- A plan's pointers are valid while the model's modules and tensors are the objects it was built
  from and the KV cache is the same tensor. Reassigning an attribute of a layer's modules bumps
  `structure.version()` (WatchedModule); a plan built at another version, or for another cache, is
  rebuilt before use. Changes in place (smoothing scales, loading a checkpoint) keep the pointers.
- Which layers fuse depends on the row count: a linear whose float crossover (Int8Dispatch) is at
  or below it runs as float32 GEMM, so its layer runs op by op. The runs of fusable layers per row
  count are cached under the dispatchers' versions, which every threshold change bumps.
- The C code runs the same kernels in the same order as the layers' Python: the same bits. A MoE
  layer's router scores and routes with the C kernels in Python too (router.py), so this holds there.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from inferplane.api.model_config import FULL, SLIDING, ModelConfig
from inferplane.worker.ops import native, structure
from inferplane.worker.ops.attention import AttentionBatch
from inferplane.worker.ops.kv_cache import PagedKVCache
from inferplane.worker.ops.norm import RMSNorm

Segment = tuple[int, int, object]  # (first layer, end, ctypes array of LayerWeights or None: op by op)


class DecodeStep(Protocol):
    """A forward pass's token ids and positions [T] (int64), with the embedding, its multiplier (or
    None) and the rotaries by rope kind that they index (model/step_inputs.py's StepInputs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    embedding: torch.nn.Module
    multiplier: float | None
    rotaries: dict[str, torch.nn.Module]

    @property
    def rows(self) -> int: ...

    def x(self) -> torch.Tensor: ...

    def tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


class FusedDecode:
    """The fused-decode plan of one model (LlamaForCausalLM owns one)."""

    def __init__(self, config: ModelConfig, body: torch.nn.Module):
        self.config = config
        self.body = body  # its `layers`, read at each build (a reassigned list bumps the version)
        self.layers: torch.nn.ModuleList | None = None
        self.builds = 0  # plans built: one per model and cache unless the structure changes
        self._key: tuple | None = None
        self._linears: list[tuple] = []  # per layer: its linears (a MoE layer's router and experts), or None
        self._weights: list = []  # per layer: native.LayerWeights or None
        self._keep: list[torch.Tensor] = []  # what the pointers point into
        self._structs: list = []  # the MoE layers' ctypes structures the entries point to
        self._segments: dict[tuple, list[Segment]] = {}
        self._dispatches: list = []
        self._caches_read = False  # the plan's KV pools are what the attention kernels read
        self._final_norm: RMSNorm | None = None  # the final norm where the C call can run it
        self._head: tuple = (None, None)  # the head's operands (held) and the LinearOperands made of them

    def _build(self, cache: PagedKVCache, key: tuple, kernels: native.NativeKernels) -> None:
        self._key, self._segments, self._keep, self._structs = key, {}, [], []
        self._linears, self._weights, dispatches = [], [], {}
        self.builds += 1
        self.layers = self.body.layers
        self._caches_read = all(
            kernels.reads_kv_cache(data) for data in (cache.data, cache.window_data) if data is not None)
        norm = self.body.norm
        self._final_norm = norm if type(norm) is RMSNorm and native.float32_rows(norm.weight) else None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            experts = getattr(mlp, "experts", None)  # moe.SparseMoE: its router, then every expert's two
            if experts is None:
                linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                operands = [linear_operands(lin) for lin in linears]
            else:
                linears = (attn.qkv_proj, attn.o_proj, mlp.gate, *(e.gate_up_proj for e in experts),
                           *(e.down_proj for e in experts))
                operands = [linear_operands(attn.qkv_proj), linear_operands(attn.o_proj), _router_operands(mlp.gate),
                            *(linear_operands(lin) for lin in linears[3:])]
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
                if hasattr(lin, "dispatch"):  # a float32 router has no float crossover
                    dispatches[id(lin.dispatch)] = lin.dispatch
            entry = native.LayerWeights()
            entry.norm1, entry.norm2 = norms[0].data_ptr(), norms[1].data_ptr()
            entry.q_norm, entry.k_norm, entry.norm3, entry.norm4 = (None if w is None else w.data_ptr() for w in extra)
            entry.window = attn.window or 0
            entry.softcap = attn.softcap or 0.0
            entry.view = int(cache.is_windowed(attn.layer_index))
            entry.rope = int(layer.rope_kind == SLIDING)
            for i, (weight, scale, bits, bias, _) in enumerate(operands[:2] if experts is not None else operands):
                entry.w[i], entry.s[i], entry.bias[i] = _pointer(weight), _pointer(scale), _pointer(bias)
                entry.bits[i] = bits
            self._keep.extend(t for operand in operands for t in operand if isinstance(t, torch.Tensor))
            if experts is not None:
                entry.moe = ctypes.addressof(self._experts(mlp, operands[2:]))
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            self._keep.extend((*norms, k_cache, v_cache))
            self._linears.append(linears)
            self._weights.append(entry)
        self._dispatches = list(dispatches.values())

    def _experts(self, moe: torch.nn.Module, operands: list[tuple]) -> native.MoeWeights:
        """A MoE layer's router and experts (operands: the router's, every expert's gate_up, then
        every expert's down) as csrc/decode_layers.c's ip_moe; kept alive with the plan."""
        count = len(moe.experts)
        gate_up = (native.LinearOperands * count)(*(_linear(o) for o in operands[1:1 + count]))
        down = (native.LinearOperands * count)(*(_linear(o) for o in operands[1 + count:]))
        experts = native.MoeWeights(_linear(operands[0]), ctypes.addressof(gate_up), ctypes.addressof(down), count,
                                    moe.top_k, operands[1][4] // 2, int(moe.normalize))
        self._structs.extend((gate_up, down, experts))
        return experts

    def _segments_for(self, rows: int) -> list[Segment]:
        key = (rows, *(d.version for d in self._dispatches))
        found = self._segments.get(key)
        if found is None:
            fusable = [linears is not None and all(rows < lin.float_rows() for lin in linears
                                                   if hasattr(lin, "float_rows"))  # a float32 router has none
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

    def forward(self, step: DecodeStep, cache: PagedKVCache, batch: AttentionBatch,
                head: Callable[[int], tuple | None] | None = None, steps: int = 1,
                stop_ids: frozenset[int] = frozenset(), draws: BurstDraws | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """(x after every decoder layer and the final norm, the logits of every row or None, each
        row's argmax of them or None). `steps` > 1 asks for a burst of greedy steps in one C call
        (native decode_steps, ending after a step where a row's token is in `stop_ids`), which runs
        where every layer is fused, the call looks the inputs up and runs the head: the third item is
        then each step's argmax [steps run, rows] (the logits and x are the last step's), or with
        `draws`, each sampled row's draw instead (csrc/sample.c, in the same call); elsewhere
        one step runs as without it. Fused
        runs in C and the rest op by op; None where the step is not decode rows only or the C kernels
        do not apply (the caller then runs every layer). Where the first run of layers is fused and
        the step's sources allow it (decode_inputs), its C call looks up x and the rope rows
        itself. `head(rows)`: the head's operands where the model would run the same C kernel for
        that many rows (else None). Where the last run of layers is fused, the final norm and that
        head run in its C call: a PyTorch op right after the layers ran with the caches their weights
        had just swept (the final norm: 0.15 ms against 0.02 ms warm, on SmolLM2's batch-1 step), so
        the step's end moves into C with them."""
        rows = step.rows
        kernels = native.kernels()
        if batch.num_decodes != rows or batch.prefills or kernels is None or not kernels.has_int8_linear:
            return None
        # the kernels build too: whether it reads the caches (float16 ones: F16C) is checked per plan
        key = (structure.version(), kernels, id(cache), cache.data.data_ptr(),
               None if cache.window_data is None else cache.window_data.data_ptr())
        if key != self._key:
            self._build(cache, key, kernels)
        views = [_decode_view(batch)]
        if cache.window_data is not None:
            views.append(_decode_view(batch.window))
        if not self._caches_read or any(view is None for view in views):
            return None
        lookups = decode_inputs(step)
        # x: a buffer the C call fills, or the embedded rows, which must then be float32 rows
        x = torch.empty(rows, self.config.hidden_size, dtype=torch.float32) if lookups is not None else step.x()
        if lookups is None and (x.dim() != 2 or not native.float32_rows(
                x, *(t for ts in step.tables().values() for t in ts))):
            return None
        segments = self._segments_for(rows)
        if len(segments) == 1 and segments[0][2] is None:
            return None
        if segments[0][2] is None and lookups is not None:  # the first layers run op by op, from x
            lookups, x = None, step.x()
        config = self.config
        shape = (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size)
        views.append(views[0])  # no window pool: no layer names view 1
        tail = logits = argmax = None
        for start, end, weights in segments:
            if weights is None:
                for layer in self.layers[start:end]:
                    x = layer(x, step.tables()[layer.rope_kind], cache, batch)
                continue
            x = x.contiguous()
            if end == len(self.layers):
                tail, logits, argmax = self._tail(x, head)
            if steps > 1 and start == 0 and argmax is not None and lookups is not None:  # the whole model, one call
                scratch = draws.attach(tail, logits) if draws is not None else None
                tokens = kernels.decode_steps(x, weights, config.rms_norm_eps, shape, views[:2], cache.block_size,
                                              config.attention_scale, kv_half=cache.data.dtype == torch.float16,
                                              gelu=config.hidden_act == "gelu_tanh", tail=tail, inputs=lookups,
                                              steps=steps, stop_ids=stop_ids)
                del scratch  # alive until the call returned
                return x, logits, tokens
            ropes = None
            if start > 0 or lookups is None:
                tables = step.tables()
                ropes = [tables[FULL], tables.get(SLIDING, tables[FULL])]
            kernels.decode_layers(x, weights, config.rms_norm_eps, shape, ropes, views[:2], cache.block_size,
                                  config.attention_scale, kv_half=cache.data.dtype == torch.float16,
                                  gelu=config.hidden_act == "gelu_tanh", tail=tail,
                                  inputs=lookups if start == 0 else None)
        if tail is None:
            return self.body.norm(x), None, None
        return x, logits, argmax

    def _tail(self, x: torch.Tensor, head: Callable[[int], tuple | None] | None
              ) -> tuple[native.DecodeTail | None, torch.Tensor | None, torch.Tensor | None]:
        """The final norm and head for the last fused run's C call, with the logits buffer the head
        writes and the buffer of each row's argmax (None, None: no head there); (None, None, None)
        where the final norm is not the plain RMSNorm on float32 rows (then the norm, and the head,
        run op by op as before)."""
        norm = self._final_norm
        if norm is None:
            return None, None, None
        tail = native.DecodeTail(norm=norm.weight.data_ptr(), eps=norm.eps)
        operands = None if head is None else head(x.shape[0])
        if operands is None:
            return tail, None, None
        if operands is not self._head[0]:  # the head's struct, made again only for another answer
            self._head = (operands, _linear(operands))
        logits = torch.empty(x.shape[0], operands[4], dtype=torch.float32)
        argmax = torch.empty(x.shape[0], dtype=torch.int64)
        tail.head, tail.logits, tail.argmax = self._head[1], logits.data_ptr(), argmax.data_ptr()
        return tail, logits, argmax


@dataclass
class BurstDraws:
    """What a burst of decode steps samples its sampled rows by: per row its temperature (0: greedy),
    top_k, top_p and min_p, and its uniform draw at each step [steps, rows] (sampling.uniform_draw
    of its key and that step's position), so a burst draws what single steps would have."""

    temperature: torch.Tensor  # float32 [rows]
    top_k: torch.Tensor  # int64 [rows]
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]
    uniform: torch.Tensor  # float64 [steps, rows]

    def attach(self, tail: native.DecodeTail, logits: torch.Tensor) -> torch.Tensor:
        """Points the tail's sampling fields at these tensors; returns the scratch the C call draws
        in (as large as the logits), which the caller keeps alive until the call returned."""
        scratch = torch.empty_like(logits)
        tail.temperature, tail.top_k = self.temperature.data_ptr(), self.top_k.data_ptr()
        tail.top_p, tail.min_p = self.top_p.data_ptr(), self.min_p.data_ptr()
        tail.uniform, tail.weights = self.uniform.data_ptr(), scratch.data_ptr()
        return scratch


def linear_operands(lin: torch.nn.Module) -> tuple | None:
    """(weight, scale, bits, bias, outputs) of a linear as csrc/decode_layers.c's ip_linear reads it: packed int8
    with its scale (bits 0) or GGUF blocks (no scale, their bits); None where the C kernels do not
    read it."""
    found = lin.fused_operands() if hasattr(lin, "fused_operands") else None
    if found is None:
        return None
    weight, scale, bias = found
    return weight, scale, lin.bits if scale is None else 0, bias, lin.out_features


def _router_operands(gate: torch.nn.Module) -> tuple | None:
    """A MoE router's operands: cpu-int8 keeps it float32 (bits FLOAT32_BITS, read where the float32
    kernel reads it, the test router.ExpertRouter makes too); a quantized one as any linear's."""
    if type(gate) is not torch.nn.Linear:
        return linear_operands(gate)
    kernels = native.kernels()
    if kernels is None or not kernels.f32_weight_applies(gate.weight):
        return None
    return gate.weight, None, native.FLOAT32_BITS, gate.bias, gate.out_features


def _decode_view(view: AttentionBatch | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A pool's (slots, block tables, context lengths) for the C call, or None where the attention
    kernel does not read them (native.decode_views_read: the part of decode_attention_applies that
    changes per step; the caches and the query rows are checked once per plan)."""
    if view is None:
        return None
    tables, lens = view.decode_block_tables, view.decode_context_lens
    if tables is None or lens is None or not native.decode_views_read(tables, lens):
        return None
    return view.slot_mapping, tables, lens


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(operands: tuple) -> native.LinearOperands:
    weight, scale, bits, bias, outputs = operands
    return native.LinearOperands(_pointer(weight), _pointer(scale), _pointer(bias), bits, outputs)


def decode_inputs(step: DecodeStep) -> native.DecodeInputs | None:
    """The C call's own lookups of a step's rows (x and the rope rows), where the sources are what
    it reads (a plain float32 embedding table, int64 ids and positions, float32 rope tables, all
    contiguous on the CPU); None otherwise. The caller keeps this object alive while the call runs.
    The tables are checked once for each set of them (_table_lookups); a step checks its ids and
    positions. What the call writes is what step.x() and step.tables() compute: the embedding's
    rows (times the multiplier rounded to float32, Gemma's) and the rope tables' rows."""
    ids, positions = step.input_ids, step.positions
    if not (ids.dtype is torch.int64 and positions.dtype is torch.int64 and ids.is_cpu and positions.is_cpu
            and ids.is_contiguous() and positions.is_contiguous()):
        return None
    tables = _table_lookups(step.embedding, step.multiplier, step.rotaries)
    if tables is None:
        return None
    found = native.DecodeInputs.from_buffer_copy(tables)
    found.token_ids, found.positions = ids.data_ptr(), positions.data_ptr()
    return found


# Per embedding module: (the tables its lookups were checked with, their DecodeInputs without ids
# and positions, or None where the C call does not read them). Weak: a dropped model drops its entry.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _table_lookups(embedding: nn.Module, multiplier: float | None,
                   rotaries: dict[str, nn.Module]) -> native.DecodeInputs | None:
    """DecodeInputs naming the embedding and rope tables (ids and positions unset), or None where the
    C call does not read them; checked once for each set of tables (the same rotaries and multiplier
    over the same storage: a reassigned tensor has another address and is checked again)."""
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
        return None
    full = rotaries[FULL]
    local = rotaries.get(SLIDING, full)
    weight = embedding.weight
    tables = (full.cos, full.sin, local.cos, local.sin)
    key = (full, local, multiplier, weight.data_ptr(), *(t.data_ptr() for t in tables))
    checked = _CHECKED.get(embedding)
    if checked is not None and checked[0] == key:
        return checked[1]
    found = None
    scale = 0.0 if multiplier is None else float(torch.tensor(multiplier, dtype=torch.float32))
    # a multiplier that rounds to 0.0 is not looked up in C: 0.0 means "none" to the C side
    if (native.float32_rows(weight, *tables) and full.cos.shape == local.cos.shape
            and (multiplier is None or scale != 0.0)):
        found = native.DecodeInputs(None, None, weight.data_ptr(), scale)
        found.cos[0], found.signed_sin[0] = full.cos.data_ptr(), full.sin.data_ptr()
        found.cos[1], found.signed_sin[1] = local.cos.data_ptr(), local.sin.data_ptr()
        found.vocab, found.max_positions = weight.shape[0], full.cos.shape[0]
    _CHECKED[embedding] = (key, found)
    return found
