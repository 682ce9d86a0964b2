"""Turning a loaded float32 model into the cpu-int8 runtime's model, in place, behind the quality gate.

`quantize_loaded_model` is what `runtimes.prepare_weights` calls for runtime "cpu-int8": it scores a
short slice of the evaluation text with the float32 model, swaps every linear layer for an
`Int8Linear` (from GGUF Q8_0 blocks where the file has them), scores the slice again, and raises
`QualityGateFailed` when perplexity rose past the threshold, so a worker never serves a model that
quantization broke. Embeddings stay float32; the output head is int8 unless `quantize_head` is False.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from inferplane.worker.model.moe import SparseMoE
from inferplane.worker.ops import native
from inferplane.worker.ops.native.choice import NEVER
from inferplane.worker.ops.norm import RMSNorm
from inferplane.worker.quant import gate
from inferplane.worker.quant.block_linear import BlockLinear
from inferplane.worker.quant.dispatch import calibrate, calibrate_packed, default_min_rows
from inferplane.worker.quant.gguf_blocks import Blocks
from inferplane.worker.quant.int8_linear import Int8Dispatch, Int8Linear, quantize_per_channel
from inferplane.worker.quant.smooth import (
    CALIBRATION_TOKENS,
    DEFAULT_ALPHA,
    SMOOTHED_SUFFIXES,
    input_absmax,
    load_calibration_text,
    smooth_llama,
)
from inferplane.worker.quant.startup_cache import ConversionCache

log = logging.getLogger(__name__)


class QualityGateFailed(Exception):
    """The int8 model's perplexity rose past the threshold on the evaluation slice."""


@dataclass
class ConversionReport:
    layers: list[Int8Linear | BlockLinear] = field(default_factory=list)
    dispatch: Int8Dispatch = field(default_factory=Int8Dispatch)
    source_layers: int = 0  # nn.Linear layers converted (fused ones count each)
    from_q8_0: int = 0  # of those, built directly from GGUF Q8_0 blocks
    # of those, served from the file's own blocks (BlockLinear), by block kind (native.BLOCK_KINDS)
    from_file_blocks: dict[str, int] = field(default_factory=dict)
    float_bytes: int = 0  # what the converted layers took as float32
    packed: int = 0  # layers moved to the C kernel's layout (worker/native)

    @property
    def int8_bytes(self) -> int:
        return sum(layer.weight_bytes() for layer in self.layers)


@dataclass
class _Group:
    """Linear layers that read the same input and become one Int8Linear (or a single layer)."""

    parent: nn.Module
    attr: str  # where the int8 layer goes
    members: list[tuple[str, str, nn.Linear]]  # (qualified name, attribute on parent, layer)


_FUSED = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
)


def _groups(model: nn.Module, quantize_head: bool, fuse: bool) -> list[_Group]:
    fused: set[str] = set()
    groups: list[_Group] = []
    if fuse and _is_llama_shaped(model):
        for i, layer in enumerate(model.model.layers):
            for owner, attr, names in _FUSED:
                for prefix, parent in _fusable_parents(f"model.layers.{i}.{owner}", getattr(layer, owner)):
                    linears = [getattr(parent, n, None) for n in names]
                    if not hasattr(parent, attr) or not all(isinstance(m, nn.Linear) for m in linears):
                        continue
                    members = [(f"{prefix}.{n}", n, getattr(parent, n)) for n in names]
                    groups.append(_Group(parent, attr, members))
                    fused.update(m[0] for m in members)
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if not isinstance(child, nn.Linear) or name in fused or (name == "lm_head" and not quantize_head):
                continue
            if attr == "gate" and isinstance(parent, SparseMoE):
                continue  # a MoE router stays float32 (moe.py): a few KiB, and routing is where int8 hurts
            groups.append(_Group(parent, attr, [(name, attr, child)]))
    return groups


def _fusable_parents(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of what holds a fused group's members: the module itself, or each
    expert of a Mixture-of-Experts MLP (each expert's gate and up read the same input)."""
    if isinstance(module, SparseMoE):
        return [(f"{name}.experts.{e}", expert) for e, expert in enumerate(module.experts)]
    return [(name, module)]


def _weight_name(model: nn.Module, layer_name: str) -> str:
    """The checkpoint name of a layer's weight; a tied head reads the embedding's."""
    if layer_name == "lm_head" and getattr(model.config, "tie_word_embeddings", False):
        return "model.embed_tokens.weight"
    return f"{layer_name}.weight"


def _is_llama_shaped(model: nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers)


def convert_model(model: nn.Module, *, quantize_head: bool = False, scale_multiplier: float = 1.0,
                  gguf_path: str | None = None, calibration_ids: list[int] | None = None,
                  smooth_alpha: float | None = DEFAULT_ALPHA, fuse: bool = True,
                  measure_dispatch: bool = True, pack: bool = True, q4_blocks: bool = False) -> ConversionReport:
    """Replaces the model's linear layers with Int8Linear in place.

    With `q4_blocks`, layers the GGUF file stores as 4-, 5-, 6- or 8-bit blocks (Q4_0/Q4_1/Q4_K,
    Q5_0/Q5_1/Q5_K, Q6_K, Q8_0: gguf_blocks.py) become BlockLinear over those very blocks (a 4-bit model stays
    4-bit, and its weights are the file's); smoothing is then off, since it would change them. Needs
    the C kernels; without them this falls back to int8.

    With `calibration_ids`, activation outliers are first folded into the weights (smooth.py). With
    `fuse`, q/k/v and gate/up become one layer each: per-row quantization makes that exactly the
    same int8 as separate layers, with three matmuls and input quantizations fewer per decoder layer.
    `scale_multiplier` != 1 stores deliberately wrong scales: a test hook proving the gate can fail.
    With `pack`, every layer whose shape fits moves to the C kernel's layout (Int8Linear.pack)
    where this machine can build it; the start-up measurement of the PyTorch kernels then only
    matters for the layers left over, and for packed ones it finds from how many rows float32
    GEMM over the dequantized weight is faster (dispatch.calibrate_packed).
    """
    groups = _groups(model, quantize_head, fuse)
    file_blocks: dict[str, Blocks] = {}
    kernels = native.kernels()
    if (q4_blocks and gguf_path is not None and gguf_path.endswith(".gguf") and kernels is not None
            and kernels.has_block_linear):
        from inferplane.worker.quant.gguf_blocks import load_blocks

        wanted = {_weight_name(model, name) for g in groups for name, _, _ in g.members}
        file_blocks = load_blocks(gguf_path, model.config, wanted)
    smoothed = False
    if calibration_ids and smooth_alpha and _is_llama_shaped(model) and not file_blocks:
        smooth_llama(model, input_absmax(model, calibration_ids), smooth_alpha)
        smoothed = True
    from_blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if gguf_path is not None and gguf_path.endswith(".gguf"):
        from inferplane.worker.quant.gguf_q8 import load_q8_0_linears

        # A smoothed layer's weights are no longer the file's, so only untouched ones can reuse blocks.
        wanted = {_weight_name(model, name) for g in groups for name, _, _ in g.members
                  if not (smoothed and name.endswith(SMOOTHED_SUFFIXES))}
        from_blocks = load_q8_0_linears(gguf_path, model.config, wanted, scale_multiplier)
    report = ConversionReport(dispatch=Int8Dispatch(default_min_rows()))
    for group in groups:
        block_layer = _block_layer(model, group, file_blocks, report, scale_multiplier)
        if block_layer is not None:
            report.layers.append(_install(group, block_layer))
            continue
        qs, scales = [], []
        for name, _, linear in group.members:
            report.float_bytes += linear.weight.numel() * 4
            report.source_layers += 1
            blocks = from_blocks.get(_weight_name(model, name))
            if blocks is not None:
                report.from_q8_0 += 1
                q, scale = blocks
            else:
                q, scale = quantize_per_channel(linear.weight, scale_multiplier)
            qs.append(q)
            scales.append(scale)
        layer = Int8Linear(torch.cat(qs), torch.cat(scales), _group_bias(group), report.dispatch)
        report.layers.append(_install(group, layer))
    _finish(report, pack, measure_dispatch)
    return report


def _group_bias(group: _Group) -> torch.Tensor | None:
    biases = [linear.bias for _, _, linear in group.members]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach().float() if b is not None else torch.zeros(linear.out_features)
                      for b, (_, _, linear) in zip(biases, group.members, strict=True)])


def _block_layer(model: nn.Module, group: _Group, file_blocks: dict[str, Blocks], report: ConversionReport,
                 scale_multiplier: float = 1.0) -> BlockLinear | None:
    """The group as one BlockLinear over the file's blocks, when the file has them for every member
    (at the widest member's bits: 4-bit values are the same numbers in 5; `scale_multiplier`, the
    gate's test hook, scales every weight: d and m alike)."""
    parts = [file_blocks.get(_weight_name(model, name)) for name, _, _ in group.members]
    if not file_blocks or any(b is None for b in parts):
        return None
    in_features = group.members[0][2].in_features
    if not native.block_shape_supported(sum(b.rows for b in parts), in_features):
        return None
    blocks = Blocks.stacked(parts)
    if blocks is None:
        return None
    for _, _, linear in group.members:
        report.float_bytes += linear.weight.numel() * 4
        report.source_layers += 1
    kind = native.BLOCK_KINDS[blocks.bits]
    report.from_file_blocks[kind] = report.from_file_blocks.get(kind, 0) + len(group.members)
    if scale_multiplier != 1.0:
        blocks = blocks.scaled(scale_multiplier)
    return BlockLinear(blocks, _group_bias(group), report.dispatch)


def _install(group: _Group, layer: nn.Module) -> nn.Module:
    for _, attr, _ in group.members:
        delattr(group.parent, attr)
    setattr(group.parent, group.attr, layer)
    return layer


def _finish(report: ConversionReport, pack: bool, measure_dispatch: bool) -> None:
    if pack:
        report.packed = sum(layer.pack() for layer in report.layers if isinstance(layer, Int8Linear))
    if measure_dispatch:
        calibrate([layer for layer in report.layers if not layer.is_packed], report.dispatch)
        calibrate_packed(report.layers, report.dispatch)


def _block_entry(layer: BlockLinear) -> dict:
    """A BlockLinear as plain tensors (the start-up cache loads with weights_only)."""
    blocks = layer.file_blocks()
    return {"values": blocks.values, "d": blocks.d, "m": blocks.m, "bits": blocks.bits, "bias": layer.bias}


def snapshot(model: nn.Module, report: ConversionReport) -> dict:
    """What convert_model computed, in a form any CPU can restore: each int8 layer's plain int8
    weight, scales and bias in conversion order, and the RMSNorm weights (smoothing divided them)."""
    return {
        "layers": [_block_entry(layer) if isinstance(layer, BlockLinear) else
                   {"qweight": layer.int8_weight(), "scale": layer.scale, "bias": layer.bias}
                   for layer in report.layers],
        "norms": {name: module.weight.detach().clone() for name, module in model.named_modules()
                  if isinstance(module, RMSNorm)},
        "smoothing": dict(getattr(model, "smoothing", None) or {}),
        "source_layers": report.source_layers, "from_q8_0": report.from_q8_0,
        "from_file_blocks": report.from_file_blocks,
        "float_bytes": report.float_bytes,
    }


def restore(model: nn.Module, saved: dict, *, quantize_head: bool = False, fuse: bool = True,
            measure_dispatch: bool = True, pack: bool = True) -> ConversionReport:
    """convert_model's result from a snapshot of the same model file and settings, without
    calibrating, smoothing or quantizing again. Raises ValueError where the snapshot does not fit."""
    groups = _groups(model, quantize_head, fuse)
    if len(groups) != len(saved["layers"]):
        raise ValueError(f"snapshot has {len(saved['layers'])} int8 layers, the model {len(groups)}")
    norms = dict(model.named_modules())
    for name, weight in saved["norms"].items():
        if name not in norms or norms[name].weight.shape != weight.shape:
            raise ValueError(f"snapshot norm {name} does not fit the model")
    report = ConversionReport(dispatch=Int8Dispatch(default_min_rows()), source_layers=saved["source_layers"],
                              from_q8_0=saved["from_q8_0"], from_file_blocks=dict(saved["from_file_blocks"]),
                              float_bytes=saved["float_bytes"])
    layers = []
    for group, entry in zip(groups, saved["layers"], strict=True):
        rows = sum(linear.out_features for _, _, linear in group.members)
        in_features = group.members[0][2].in_features
        if "bits" in entry:
            blocks = Blocks(entry["values"], entry["d"], entry["m"], entry["bits"])
            layers.append(BlockLinear(blocks, entry["bias"], report.dispatch))
            if (layers[-1].out_features, layers[-1].in_features) != (rows, in_features):
                raise ValueError(f"snapshot layer {group.members[0][0]} has shape "
                                 f"{(layers[-1].out_features, layers[-1].in_features)}")
            continue
        if tuple(entry["qweight"].shape) != (rows, in_features):
            raise ValueError(f"snapshot layer {group.members[0][0]} has shape {tuple(entry['qweight'].shape)}")
        layers.append(Int8Linear(entry["qweight"], entry["scale"], entry["bias"], report.dispatch))
    report.layers = [_install(group, layer) for group, layer in zip(groups, layers, strict=True)]
    with torch.no_grad():
        for name, weight in saved["norms"].items():
            norms[name].weight.copy_(weight)
    if saved.get("smoothing"):
        model.smoothing = dict(saved["smoothing"])
    _finish(report, pack, measure_dispatch)
    return report


def model_bytes(model: nn.Module) -> int:
    """Parameters and persistent buffers, each tensor counted once (a tied head is the embedding)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + [b for _, b in model.named_buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def calibration_tokens(loaded) -> list[int]:
    """The calibration text's tokens; without a tokenizer, fixed pseudo-random ids (the channels
    that carry outliers in these models do so for almost any input)."""
    if loaded.tokenizer is not None:
        return loaded.tokenizer.encode(load_calibration_text())[:CALIBRATION_TOKENS]
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, loaded.config.vocab_size, (256,), generator=gen).tolist()


def cache_settings(quantize_head: bool, multiplier: float, gated: bool, q4_blocks: bool) -> dict:
    """What a stored conversion depends on besides the file and the code. The kernel build is part
    of it because the stored gate figures were measured on it: the builds' float sums (norms, exp)
    differ in their last bits, which re-rolls some rows' int8 activation rounding, and SmolLM2's
    int8-head gate read +1.15% on the AVX-512 build and +0.36% on the AVX2 one. A start on another
    build converts (cheaply: the same weights) and measures its own."""
    kernels = native.kernels()
    return {"quantize_head": quantize_head, "scale_multiplier": multiplier, "gate": gated, "q4_blocks": q4_blocks,
            "gate_tokens": gate.STARTUP_TOKENS, "threshold_pct": gate.DEFAULT_THRESHOLD_PCT,
            "kernels": kernels.isa if kernels is not None else "torch"}


def _check_device(loaded) -> None:
    param = next(loaded.model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"runtime cpu-int8 runs on the CPU, but the model was loaded on {param.device}; "
                         "pass device='cpu' (or --device cpu)")
    if param.dtype != torch.float32:
        raise ValueError(f"runtime cpu-int8 keeps activations in float32, got dtype {param.dtype}; "
                         "pass dtype='float32' or leave it unset")


def quantize_loaded_model(loaded, options) -> dict[str, float]:
    """Converts `loaded.model` in place; returns figures for Stats and metrics. Raises
    QualityGateFailed unless the gate passes or `options.skip_quality_gate` is set."""
    _check_device(loaded)
    model = loaded.model
    skip = bool(getattr(options, "skip_quality_gate", False))
    quantize_head = getattr(options, "quantize_head", None) is not False  # unset: the int8 head (the default)
    multiplier = float(getattr(options, "quant_scale_multiplier", 1.0))
    q4_blocks = not bool(getattr(options, "requantize_q4", False))
    bytes_before = model_bytes(model)

    cache = ConversionCache.for_model(loaded.path, cache_settings(quantize_head, multiplier, not skip, q4_blocks))
    saved = cache.load() if cache is not None else None
    report = None
    if saved is not None and "conversion" in saved and (skip or "gate" in saved):
        try:
            report = restore(model, saved["conversion"], quantize_head=quantize_head)
        except (KeyError, ValueError) as exc:  # restore checks before it changes the model
            log.warning("int8 start-up cache %s does not fit %s, converting again: %s", cache.path, loaded.name, exc)
    restored = report is not None
    gate_figures = saved.get("gate") if restored else None

    reference: gate.Reference | None = None
    if not skip and gate_figures is None:
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.name}: the int8 quality gate needs the model's tokenizer to read its "
                             "evaluation text; start with --skip-quality-gate to serve without the gate")
        slice_ids = gate.eval_tokens(loaded.tokenizer, gate.STARTUP_TOKENS)
        reference = gate.Reference(model, slice_ids)

    if report is None:
        report = convert_model(model, quantize_head=quantize_head, scale_multiplier=multiplier,
                               gguf_path=loaded.path, calibration_ids=calibration_tokens(loaded), q4_blocks=q4_blocks)
    figures: dict[str, float] = {
        "weight_bytes_int8": float(report.int8_bytes),
        "weight_bytes_float32": float(report.float_bytes),
        "weight_bytes_ratio": report.int8_bytes / max(report.float_bytes, 1),
        "model_bytes_float32": float(bytes_before),
        "model_bytes_int8": float(model_bytes(model)),
        "int8_layers": float(len(report.layers)),
        "int8_layers_from_q8_0": float(report.from_q8_0),
        # linears served from the file's own blocks, by kind: q4_1_layers_from_file, ...
        **{f"{kind}_layers_from_file": float(report.from_file_blocks.get(kind, 0))
           for kind in native.BLOCK_KINDS.values()},
        "int8_layers_packed": float(report.packed),
        # from how many rows some packed layer multiplies in float32 instead (0: none does)
        "int8_float_gemm_from_rows": float(min((r for r in report.dispatch.float_from.values() if r < NEVER),
                                               default=0)),
        "gate_skipped": 1.0 if skip else 0.0,
        "startup_cache_hit": 1.0 if restored else 0.0,
    }
    if skip:
        if cache is not None and not restored:
            cache.save({"conversion": snapshot(model, report)})
        return figures
    if gate_figures is None:
        assert reference is not None
        with report.dispatch.int8_only():  # the gate scores int8 activations, the path decode takes
            result = reference.score(model, gate.DEFAULT_THRESHOLD_PCT)
        del reference  # the float head of an untied model goes with it
        gate_figures = result.figures()
        if result.passed and cache is not None:  # a failed conversion is not kept: the next start retries
            cache.save({"conversion": snapshot(model, report), "gate": gate_figures})
    figures.update(gate_figures)
    if figures["gate_ppl_rise_pct"] > figures["gate_threshold_pct"]:
        raise QualityGateFailed(
            f"int8 quality gate failed for {loaded.name}: perplexity rose {figures['gate_ppl_rise_pct']:.2f}% "
            f"(> {figures['gate_threshold_pct']:.2f}%) on {int(figures['gate_tokens'])} tokens; refusing to serve "
            "(start with --skip-quality-gate to serve anyway)"
        )
    return figures
