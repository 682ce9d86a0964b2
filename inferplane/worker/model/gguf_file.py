"""Reading GGUF files' tensors as float torch tensors in HF naming (their metadata becomes a
ModelConfig in api/model_config.py, which the registry reads too).

The dequantizers are our own (a few lines each, vectorised in torch) so that the set of supported
tensor types is explicit: anything else fails with an error that names the type.
"""

from __future__ import annotations

import numpy as np
import torch

from inferplane.api.model_config import ModelConfig, ModelLoadError

# ggml's block layouts, as gguf-py's `gguf.quants` reads them (its dequantizers are the reference:
# tests/worker/test_gguf_types.py checks each of ours equals it bit for bit). Blocks of 32 weights:
#   Q8_0: f16 d, 32 int8 q                      w = d * q
#   Q4_0: f16 d, 16 bytes of nibbles            w = d * (q - 8)
#   Q4_1: f16 d, f16 m, 16 bytes                w = d * q + m
#   Q5_0: f16 d, 4 bytes of high bits, 16 bytes w = d * (q - 16)
#   Q5_1: f16 d, f16 m, 4 bytes, 16 bytes       w = d * q + m
# where the nibbles of a 16-byte run are weights 0..15 (low) and 16..31 (high), and bit i of the
# 4 high-bit bytes (little-endian) is bit 4 of weight i. K-quants: super-blocks of 256, with
# sub-block scales (see each function). Every product and sum is a float32 operation in the order
# gguf-py makes it, so the results are the same floats.
_BLOCK = 32
_QK_K = 256
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
# The integer work is done on uint8 (wrapping where a value goes negative, then read as int8), and
# the float work in place: these run over every weight of a model as it loads.


def _blocks(raw: np.ndarray, nbytes: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, nbytes).copy())


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> [..., 8, k]: bit b of every byte in row b."""
    out = packed.unsqueeze(-2) >> _BIT_SHIFTS.reshape(8, 1)
    return out.bitwise_and_(1)


def _crumbs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> [..., 4, k]: 2-bit field j of every byte (bits 2j, 2j + 1) in row j."""
    out = packed.unsqueeze(-2) >> _CRUMB_SHIFTS.reshape(4, 1)
    return out.bitwise_and_(3)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> [n, 32]: ggml stores the low nibbles of all 16 bytes first, then the high."""
    out = torch.empty(packed.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=out[:, :16])
    torch.bitwise_right_shift(packed, 4, out=out[:, 16:])
    return out


def _high_bits_32(packed: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4 bytes -> [n, 32] uint8 holding 16 where bit i of the little-endian uint32 is
    set, for weight i."""
    out = packed.unsqueeze(-1) >> _BIT_SHIFTS
    return out.bitwise_and_(1).bitwise_left_shift_(4).reshape(packed.shape[0], 32)


def _dequant_q8_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(blocks, 0))


def _dequant_q4_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 18)
    q = _nibbles(blocks[:, 2:]).sub_(8).view(torch.int8)  # q - 8, as int8
    return q.float().mul_(_f16(blocks, 0))


def _dequant_q4_1(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 20)
    return _nibbles(blocks[:, 4:]).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _dequant_q5_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 22)
    q = _nibbles(blocks[:, 6:]).bitwise_or_(_high_bits_32(blocks[:, 2:6])).sub_(16).view(torch.int8)
    return q.float().mul_(_f16(blocks, 0))


def _dequant_q5_1(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 24)
    q = _nibbles(blocks[:, 8:]).bitwise_or_(_high_bits_32(blocks[:, 4:8]))
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's (and Q5_K's) 12 bytes of 6-bit (scale, min) pairs -> [..., 8] scales and mins
    (ggml's get_scale_min_k4)."""
    s = packed.to(torch.int32)
    first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([first & 63, (third & 0xF) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales, mins


def q4_k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 bytes -> [..., 8, 32] values: blocks 2k and 2k + 1 are the low and high nibbles of
    the same 32 bytes."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_scaled(q: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [n, k] from integer q [n, j, k / j] and per-sub-block dl, ml [n, j]: dl * q (- ml)."""
    n, j = dl.shape
    out = q.float().mul_(dl.reshape(n, j, 1))
    if ml is not None:
        out.sub_(ml.reshape(n, j, 1))
    return out.reshape(n, -1)


def _dequant_q2_k(raw: np.ndarray) -> torch.Tensor:
    # 16 bytes of 4-bit (scale, min) per block of 16, 64 bytes of 2-bit q, f16 d, f16 dmin;
    # w = d * scale_j * q - dmin * min_j. Byte k of each 32-byte half holds, in bit pairs 0..3, the
    # weights k of that half's blocks of 32 in turn.
    blocks = _blocks(raw, 84)
    scales, n = blocks[:, :16], blocks.shape[0]
    dl = _f16(blocks, 80) * (scales & 0xF).float()
    ml = _f16(blocks, 82) * (scales >> 4).float()
    q = _crumbs(blocks[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16)
    return _k_scaled(q, dl, ml)


def _dequant_q3_k(raw: np.ndarray) -> torch.Tensor:
    # 32 bytes of high-bit mask, 64 bytes of 2-bit low parts, 12 bytes of 6-bit scales (one per
    # block of 16, less 32), f16 d; w = d * (scale_j - 32) * (low - 4 * (1 - high)).
    blocks = _blocks(raw, 110)
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    low = torch.stack([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=1).reshape(n, 16)
    high = _crumbs(packed[:, 8:12]).reshape(n, 16)
    dl = _f16(blocks, 108) * ((low | (high << 4)).float() - 32.0)
    offset = _bits(blocks[:, :32]).bitwise_xor_(1).bitwise_left_shift_(2)  # 4 where the bit is clear
    q = _crumbs(blocks[:, 32:96].reshape(n, 2, 32)).sub_(offset.reshape(n, 2, 4, 32)).view(torch.int8)
    return _k_scaled(q.reshape(n, 16, 16), dl)


def _dequant_q4_k(raw: np.ndarray) -> torch.Tensor:
    # Super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
    # w = d * scale_j * q - dmin * min_j for block j of 32.
    blocks = _blocks(raw, 144)
    scales, mins = q4_k_scales(blocks[:, 4:16])
    dl, ml = _f16(blocks, 0) * scales.float(), _f16(blocks, 2) * mins.float()
    return _k_scaled(q4_k_nibbles(blocks[:, 16:]), dl, ml)


def _dequant_q5_k(raw: np.ndarray) -> torch.Tensor:
    # Q4_K's layout with 32 bytes of fifth bits after the scales: bit j of byte k is the high bit of
    # weight k of block j.
    blocks = _blocks(raw, 176)
    scales, mins = q4_k_scales(blocks[:, 4:16])
    dl, ml = _f16(blocks, 0) * scales.float(), _f16(blocks, 2) * mins.float()
    q = q4_k_nibbles(blocks[:, 48:]).bitwise_or_(_bits(blocks[:, 16:48]).bitwise_left_shift_(4))
    return _k_scaled(q, dl, ml)


def _dequant_q6_k(raw: np.ndarray) -> torch.Tensor:
    # 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per block of 16),
    # f16 d; w = d * scale_j * (q - 32). Per half of 128 weights: 64 bytes of nibbles (low nibbles
    # are weights 0..63, high 64..127) and 32 bytes of high parts (bit pair j of byte k: weight
    # 32 j + k).
    blocks = _blocks(raw, 210)
    n = blocks.shape[0]
    q = q6_k_values(blocks).sub_(32).view(torch.int8)
    dl = _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()
    return _k_scaled(q.reshape(n, 16, 16), dl)


def q6_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks uint8 [n, 210] -> their 6-bit values uint8 [n, 256] in weight order (q,
    before the - 32)."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(n, 2, 4, 32)
    qh = _crumbs(blocks[:, 128:192].reshape(n, 2, 32)).bitwise_left_shift_(4)
    return ql.bitwise_or_(qh).reshape(n, 256)


def _f16_to_f32(raw: np.ndarray) -> torch.Tensor:
    halves = np.ascontiguousarray(raw).view(np.float16).reshape(-1)
    out = torch.from_numpy(halves.view(np.int16).copy()).view(torch.float16).float()
    nan = out.isnan()
    if nan.any():  # torch makes every NaN one NaN; numpy (and gguf-py) keeps each payload
        out[nan] = torch.from_numpy(halves[nan.numpy()].astype(np.float32))
    return out


_QUANTIZED = {
    "Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1, "Q5_0": _dequant_q5_0,
    "Q5_1": _dequant_q5_1, "Q2_K": _dequant_q2_k, "Q3_K": _dequant_q3_k, "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k, "Q6_K": _dequant_q6_k,
}
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", *_QUANTIZED)


def dequantize(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Returns a float32 tensor of `shape` (rows first, as PyTorch orders a weight). `raw` is the
    tensor's data as the reader gives it (its own dtype for F32/F16/BF16, uint8 otherwise) or its bytes."""
    if type_name == "F32":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float32).copy()).reshape(shape)
    if type_name == "F16":
        return _f16_to_f32(raw).reshape(shape)
    if type_name == "BF16":  # bfloat16 -> float32 is the bits shifted up, NaN payloads and all
        as_int = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16).copy())
        return as_int.view(torch.bfloat16).float().reshape(shape)
    if type_name in _QUANTIZED:
        return _QUANTIZED[type_name](raw).reshape(shape)
    raise ModelLoadError(
        f"GGUF tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
    )


def open_gguf(path: str):
    """The file's reader (api/gguf_reader.py: read once per process while the file is unchanged), or
    a ModelLoadError saying why it cannot be read."""
    from inferplane.api.gguf_reader import open_gguf as read

    try:
        reader = read(path)
        _ = reader.tensors  # read on first use: a damaged table is this load's error, here
        return reader
    except (OSError, ValueError) as exc:  # GGUFFormatError is a ValueError
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a MoE layer's router
}
# Gemma's sandwich: llama.cpp's ffn_norm is the MLP's input norm, which Gemma names pre-feedforward
# (Llama's post_attention_layernorm); Gemma's post-attention norm is a separate tensor.
_SANDWICH_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# A MoE layer's experts stacked in one tensor [experts, rows, columns]: split per expert.
_STACKED_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                    "ffn_down_exps.weight": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, sandwich: bool = False) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3:
        if sandwich and parts[2] in _SANDWICH_NAMES:
            return f"model.layers.{parts[1]}.{_SANDWICH_NAMES[parts[2]]}"
        if parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of q/k rows (its RoPE pairs adjacent
    elements); HF-style rotate_half pairs the two halves, so the rows are put back."""
    out = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


# Families whose converter interleaves q/k rows for llama.cpp's adjacent-pair RoPE (the others use
# its NeoX-style RoPE, as HF does).
_PERMUTED_ROPE = ("llama", "mistral", "mixtral")


def permuted_rope_heads(config: ModelConfig, name: str) -> int | None:
    """The head count whose rotary row interleaving must be undone for tensor `name` (HF naming),
    or None where the file stores its rows in HF order. The one rule for every reader of GGUF rows."""
    if config.architecture not in _PERMUTED_ROPE:
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_kv_heads
    return None


def linear_tensor_name(gguf_name: str, config: ModelConfig) -> str | None:
    """The HF name of a 2-D linear weight stored under `gguf_name`, None for anything else (norms,
    experts stacked in 3-D: expert_tensor_names): what the cpu-int8 block readers look up."""
    if expert_tensor_names(gguf_name, 0) is not None:
        return None
    return hf_name(gguf_name, config.sandwich_norms)


def expert_tensor_names(gguf_name: str, experts: int) -> list[str] | None:
    """The HF name of each expert's weight, in expert order, where `gguf_name` is a MoE layer's
    experts stacked in one tensor [experts, rows, columns]; None for any other tensor."""
    parts = gguf_name.split(".", 2)
    if parts[0] != "blk" or len(parts) != 3 or parts[2] not in _STACKED_EXPERTS:
        return None
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{_STACKED_EXPERTS[parts[2]]}.weight" for e in range(experts)]


def load_gguf_tensors(reader, config: ModelConfig):
    """Yields (hf_name, float32 tensor) for every tensor in the file."""
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        tensor = dequantize(t.tensor_type.name, t.data, shape)
        experts = expert_tensor_names(t.name, shape[0])
        if experts is not None:
            yield from zip(experts, tensor, strict=True)
            continue
        name = hf_name(t.name, config.sandwich_norms)
        heads = permuted_rope_heads(config, name)
        yield name, tensor if heads is None else _unpermute_rope(tensor, heads)
