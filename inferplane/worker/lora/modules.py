"""Projections that add their rows' adapters to the base: `AdapterProjection` wraps a base linear
(float, int8 or GGUF blocks alike: the base runs as it would without adapters) and `install` puts
one around every served projection of a model.

Why a wrapper and not new layer code: a weight format may fuse q/k/v (and gate/up) into one linear
(quant/convert.py); the wrapper knows which output columns belong to which module, so the layers'
code and the fused formats are unchanged. Attributes the wrapper does not have are the base's
(the fused decode reads `fused_operands`, `dispatch`, `bits` from it), and a step with no adapter
rows never reaches the adapter code (LlamaForCausalLM keeps the fused decode for those steps).
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.worker.lora.adapter import ATTENTION_MODULES, MLP_MODULES, module_shape
from inferplane.worker.lora.slots import AdapterSlots, SlotWeights


class AdapterProjection(nn.Module):
    """base(x) plus, per part (one module's output columns), the adapter delta of each row."""

    def __init__(self, base: nn.Module, parts: list[tuple[int, SlotWeights]], slots: AdapterSlots):
        super().__init__()
        self.base = base
        self.parts = parts  # (first output column, that module's stacked weights)
        self.slots = slots

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.slots.batch
        if batch is None:
            return y
        # Each slot's rows meet that slot's weights only (slots.py): no product reads another slot.
        gathered = None if batch.order is None else x.index_select(0, batch.order)
        for offset, weights in self.parts:
            if not (weights.targeted & batch.slots):
                continue
            width = weights.bt.shape[1]
            out = y if offset == 0 and width == y.shape[1] else y[:, offset:offset + width]
            if gathered is None:  # each slot's rows one run: added in place
                for group in batch.groups:
                    if group.slot in weights.targeted:
                        a, bt = weights.a[group.stacked], weights.bt[group.stacked]
                        out[group.rows].addmm_(torch.mm(x[group.rows], a.t()), bt)
                continue
            delta = y.new_empty(gathered.shape[0], width)
            for group in batch.groups:
                if group.slot in weights.targeted:
                    a, bt = weights.a[group.stacked], weights.bt[group.stacked]
                    torch.mm(torch.mm(gathered[group.rows], a.t()), bt, out=delta[group.rows])
                else:
                    delta[group.rows].zero_()
            out.index_add_(0, batch.order, delta)
        return y


def _wrap(owner: nn.Module, fused: str, modules: tuple[str, ...], layer: int, slots: AdapterSlots) -> None:
    """Wraps owner's fused projection (its parts side by side) or else each of `modules` alone."""
    fused_module = getattr(owner, fused, None)
    if fused_module is not None:
        parts, offset = [], 0
        for module in modules:
            parts.append((offset, slots.projection(layer, module)))
            offset += module_shape(slots.config, module)[1]
        setattr(owner, fused, AdapterProjection(fused_module, parts, slots))
        return
    for module in modules:
        setattr(owner, module, AdapterProjection(getattr(owner, module), [(0, slots.projection(layer, module))],
                                                 slots))


def install(model: nn.Module, slots: AdapterSlots) -> None:
    """Wraps every served projection of `model`'s decoder layers (dense MLPs only: experts are not
    served). Call once, after the weight format has converted the layers."""
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        _wrap(attn, "qkv_proj", ATTENTION_MODULES[:3], index, slots)
        attn.o_proj = AdapterProjection(attn.o_proj, [(0, slots.projection(index, "o_proj"))], slots)
        if slots.config.is_moe_layer(index):
            continue
        mlp = layer.mlp
        _wrap(mlp, "gate_up_proj", MLP_MODULES[:2], index, slots)
        mlp.down_proj = AdapterProjection(mlp.down_proj, [(0, slots.projection(index, "down_proj"))], slots)
    model.adapters = slots
