"""SmoothQuant-style rescaling before quantization, folded into neighbouring weights (free at run time).

Per-token int8 activations lose the small channels of a row when a few channels are large, and in
Llama-family models a few input channels are large in every token. Measured on SmolLM2, that alone
took the perplexity rise of dynamic int8 from 0.3% (weights only) to 3%. Dividing input channel k
by s_k and multiplying the weight's column k by s_k leaves the float product unchanged and moves the
difficulty into the weights, which are quantized per output row and absorb it far better
(Xiao et al., 2023, "SmoothQuant"). The division is folded into the layer that produces the input:

- q/k/v_proj: into input_layernorm's weight;  gate/up_proj: into post_attention_layernorm's weight;
- down_proj: into up_proj's rows (silu(gate) * up is linear in up's output).

o_proj is left as it is: its input comes out of attention, where no per-channel factor folds cleanly
under grouped-query attention, and it measured no worse than weight-only.

The per-channel input maxima come from a short calibration text that is not the evaluation text.
"""

from __future__ import annotations

from importlib import resources

import torch
from torch import nn

DEFAULT_ALPHA = 0.5
# The layers whose weights smooth_llama changes (by name suffix).
SMOOTHED_SUFFIXES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
CALIBRATION_TOKENS = 512


def load_calibration_text() -> str:
    raw = resources.files("inferplane.worker.quant").joinpath("data/calib_text.txt").read_text("utf-8")
    return "".join(line for line in raw.splitlines(keepends=True) if not line.startswith("#")).strip() + "\n"


@torch.inference_mode()
def input_absmax(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Largest |input| per input channel of every nn.Linear, over one forward pass of token_ids."""
    from inferplane.worker.quant.gate import sequence_hidden

    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            def hook(_module, args, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
                stats[name] = x if name not in stats else torch.maximum(stats[name], x)
            hooks.append(module.register_forward_pre_hook(hook))
    try:
        sequence_hidden(model, token_ids)  # the head is not smoothed: its logits are not needed
    finally:
        for h in hooks:
            h.remove()
    return stats


def _factors(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).float()
    s = act_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth_llama(model: nn.Module, stats: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> int:
    """Applies the folded rescaling to every decoder layer in place; returns how many were smoothed.
    The float model computes the same function afterwards (up to float rounding)."""
    done = 0
    factors: dict[tuple[int, str], torch.Tensor] = {}
    model.smoothing = factors  # what adapters over these weights must be rescaled by (smoothed_factors)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        key = f"{prefix}.self_attn.q_proj"
        if key in stats:
            projs = [attn.q_proj, attn.k_proj, attn.v_proj]
            s = factors[(i, "attention_input")] = _factors(stats[key], [p.weight for p in projs], alpha)
            layer.input_layernorm.weight.div_(s)
            for p in projs:
                p.weight.mul_(s[None, :])
        key = f"{prefix}.mlp.gate_proj"
        if key in stats:
            s = factors[(i, "mlp_input")] = _factors(stats[key], [mlp.gate_proj.weight, mlp.up_proj.weight], alpha)
            layer.mlp_input_norm.weight.div_(s)  # Llama's post-attention norm, Gemma's pre-feedforward
            mlp.gate_proj.weight.mul_(s[None, :])
            mlp.up_proj.weight.mul_(s[None, :])
        key = f"{prefix}.mlp.down_proj"
        if key in stats:
            s = factors[(i, "down_input")] = _factors(stats[key], [mlp.down_proj.weight], alpha)
            mlp.up_proj.weight.div_(s[:, None])
            if mlp.up_proj.bias is not None:
                mlp.up_proj.bias.div_(s)
            mlp.down_proj.weight.mul_(s[None, :])
        done += 1
    return done


def smoothed_factors(smoothing: dict[tuple[int, str], torch.Tensor] | None, layer: int,
                     module: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input factor, output divisor) of one projection after smooth_llama: its input arrives divided
    by the first and its output leaves divided by the second (up_proj, whose output down_proj reads).
    A LoRA adapter over the smoothed weights multiplies its A by the one and divides its B by the other."""
    if not smoothing:
        return None, None
    inputs = {"q_proj": "attention_input", "k_proj": "attention_input", "v_proj": "attention_input",
              "gate_proj": "mlp_input", "up_proj": "mlp_input", "down_proj": "down_input"}
    name = inputs.get(module)
    factor = smoothing.get((layer, name)) if name else None
    divisor = smoothing.get((layer, "down_input")) if module == "up_proj" else None
    return factor, divisor
