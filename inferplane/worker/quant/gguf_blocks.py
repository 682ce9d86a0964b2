"""GGUF 4-, 5-, 6- and 8-bit weights as blocks of 32, straight from the file (block_linear.BlockLinear
serves them).

Every 4- and 5-bit type here becomes values q, a float16 scale d and a float16 minimum m per block
of 32 inputs (w = d * q + m), the file's own values in every case:
- Q4_1 and Q5_1 are that already.
- Q4_0 (w = d * (q - 8)) and Q5_0 (w = d * (q - 16)) keep d and q, with m = -8 d or -16 d, which
  float16 holds exactly (a power-of-two multiple): the same weights to the bit.
- Q4_K and Q5_K (super-blocks of 256: w = d * sc_j * q - dmin * m_j with 6-bit sc_j, m_j per block j
  of 32) become one block per j with d * sc_j and -dmin * m_j rounded to float16: a relative error
  of at most 2^-11 on a block's scale, the values being the file's.
Q6_K keeps its own form, exactly: 6-bit values q, an int8 scale sc per half-block of 16 and the
super-block's float16 d (repeated per block of 32), w = d * sc * (q - 32).
Q8_0 (w = d * q with int8 q) becomes 8-bit values q + 128 with m = -128 d: exact, as for Q4_0, and
the same unsigned form, so a fused q/k/v group whose v is Q8_0 and q, k are Q5_0 (Gemma 3's Q4_K_M
file) is one 8-bit layer of the file's weights.
Other types (Q2_K, Q3_K, ...) are not read here: their layers are int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.model.gguf_file import (
    _bits,
    _f16,
    _high_bits_32,
    _nibbles,
    _unpermute_rope,
    expert_tensor_names,
    linear_tensor_name,
    open_gguf,
    permuted_rope_heads,
    q4_k_nibbles,
    q4_k_scales,
    q6_k_values,
)
from inferplane.worker.ops.native import BLOCK, Q8_MIN

_QK_K = 256
# type -> (bytes per unit, weights per unit, value bits)
BLOCK_TYPES = {"Q4_0": (18, BLOCK, 4), "Q4_1": (20, BLOCK, 4), "Q4_K": (144, _QK_K, 4),
               "Q5_0": (22, BLOCK, 5), "Q5_1": (24, BLOCK, 5), "Q5_K": (176, _QK_K, 5),
               "Q6_K": (210, _QK_K, 6), "Q8_0": (34, BLOCK, 8)}


@dataclass
class Blocks:
    """A [rows, cols] weight as blocks of 32 inputs: w = d * q + m, q < 2 ** bits (4, 5 or 8); for
    6 bits (Q6_K's form) m holds the half-blocks' int8 scales and w = d * m * (q - 32)."""

    values: torch.Tensor  # uint8 [rows, cols]
    d: torch.Tensor  # float16 [rows, cols / 32]
    m: torch.Tensor  # float16 [rows, cols / 32]; 6 bits: int8 [rows, cols / 16]
    bits: int

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] (PyTorch: the reference, and what the quality gate's float model reads)."""
        rows, cols = self.values.shape
        if self.bits == 6:  # (d * sc) * (q - 32), as gguf-py multiplies
            dsc = self.d.float().repeat_interleave(2, dim=1) * self.m.float()
            q = self.values.reshape(rows, cols // 16, 16).float() - 32
            return (dsc.unsqueeze(-1) * q).reshape(rows, cols)
        q = self.values.reshape(rows, cols // BLOCK, BLOCK).float()
        return (q * self.d.float().unsqueeze(-1) + self.m.float().unsqueeze(-1)).reshape(rows, cols)

    def scaled(self, factor: float) -> Blocks:
        """The same blocks with every weight times `factor` (the gate's test hook): d scaled, and m
        where it is a minimum (6 bits: m holds scales that d already multiplies)."""
        d = (self.d.float() * factor).half()
        return Blocks(self.values, d, self.m if self.bits == 6 else (self.m.float() * factor).half(), self.bits)

    def permuted_rows(self, heads: int) -> Blocks:
        """llama.cpp's rotary interleaving of q/k rows undone: it only permutes rows, and a row's
        blocks move with it."""
        return Blocks(*(_unpermute_rope(t, heads).contiguous() for t in (self.values, self.d, self.m)), self.bits)

    def as_8_bit(self) -> Blocks | None:
        """The same weights in Q8_0's form (m = -128 d): a symmetric block (Q4_0's m = -8 d, Q5_0's
        -16 d) moves its values up; None where a block's minimum is its own (Q4_1, the K-quants)."""
        if self.bits == 8 or self.bits == 6:
            return self if self.bits == 8 else None
        offset = 1 << (self.bits - 1)
        if not torch.equal(self.m, (self.d.float() * -offset).half()):
            return None
        return Blocks(self.values + (-Q8_MIN - offset), self.d, (self.d.float() * Q8_MIN).half(), 8)

    @staticmethod
    def stacked(parts: list[Blocks]) -> Blocks | None:
        """Rows of several weights as one (a fused layer); narrower values are the same numbers at the
        widest width. None where 6-bit parts meet others (their formulas differ), or an 8-bit part
        meets one that Q8_0's form cannot hold (as_8_bit)."""
        if len({p.bits == 6 for p in parts}) > 1:
            return None
        if max(p.bits for p in parts) == 8:
            widened = [p.as_8_bit() for p in parts]
            if any(p is None for p in widened):
                return None
            parts = widened
        return Blocks(torch.cat([p.values for p in parts]), torch.cat([p.d for p in parts]),
                      torch.cat([p.m for p in parts]), max(p.bits for p in parts))


def _raw(raw: np.ndarray, rows: int, unit_bytes: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1, unit_bytes).copy())


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def _per_32(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Blocks:
    """Q4_0, Q4_1, Q5_0, Q5_1: one unit per block of 32."""
    unit, _, bits = BLOCK_TYPES[type_name]
    b = _raw(raw, rows, unit)
    flat = b.reshape(-1, unit)
    has_min = type_name.endswith("_1")
    at = 4 if has_min else 2  # where the values (after d, and m) start
    q = _nibbles(flat[:, at + 4 * (bits == 5):])
    if bits == 5:
        q |= _high_bits_32(flat[:, at:at + 4])
    d = _half(b, 0)
    m = _half(b, 2) if has_min else (d.float() * -(1 << (bits - 1))).half()  # exact, see the docstring
    return Blocks(q.reshape(rows, cols), d, m, bits)


def _k_quant(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Blocks:
    """Q4_K, Q5_K: super-blocks of 256, one block of 32 per sub-block (see the module docstring)."""
    unit, _, bits = BLOCK_TYPES[type_name]
    b = _raw(raw, rows, unit)
    scales, mins = q4_k_scales(b[..., 4:16])
    d = (_half(b, 0).float().unsqueeze(-1) * scales.float()).half()  # [rows, supers, 8]
    m = (-(_half(b, 2).float().unsqueeze(-1) * mins.float())).half()
    q = q4_k_nibbles(b[..., 16 + 32 * (bits == 5):])  # [rows, supers, 8, 32]
    if bits == 5:
        q |= _bits(b[..., 16:48]) << 4  # bit j of byte k: the fifth bit of weight k of block j
    return Blocks(q.reshape(rows, cols).contiguous(), d.reshape(rows, -1), m.reshape(rows, -1), bits)


def _q6_k(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q6_K as it is: the values, the half-block scales, the super-block's d once per block of 32."""
    flat = _raw(raw, rows, 210).reshape(-1, 210)
    d = _f16(flat, 208).half().repeat_interleave(_QK_K // BLOCK, dim=1)
    scales = flat[:, 192:208].contiguous().view(torch.int8)
    return Blocks(q6_k_values(flat).reshape(rows, cols), d.reshape(rows, -1), scales.reshape(rows, -1), 6)


def _q8_0(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q8_0's int8 values moved up by 128 into the unsigned form, m = -128 d (exact in float16)."""
    b = _raw(raw, rows, 34)
    d = _half(b, 0)
    values = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return Blocks(values.reshape(rows, cols), d, (d.float() * Q8_MIN).half(), 8)


def file_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Blocks:
    """A tensor's bytes (one of BLOCK_TYPES, [rows, cols]) as Blocks."""
    if type_name == "Q8_0":
        return _q8_0(raw, rows, cols)
    if type_name == "Q6_K":
        return _q6_k(raw, rows, cols)
    if type_name.endswith("_K"):
        return _k_quant(raw, type_name, rows, cols)
    return _per_32(raw, type_name, rows, cols)


def load_blocks(path: str, config: ModelConfig, wanted: set[str]) -> dict[str, Blocks]:
    """Blocks for each tensor of `wanted` (HF names) that the file stores as one of BLOCK_TYPES,
    rows in HF order."""
    reader = open_gguf(path)
    found: dict[str, Blocks] = {}
    for t in reader.tensors:
        kind = BLOCK_TYPES.get(t.tensor_type.name)
        if kind is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        experts = expert_tensor_names(t.name, shape[0]) if len(shape) == 3 else None
        if experts is not None:  # a MoE layer's experts stacked [experts, rows, columns]: each its own blocks
            for name, raw in zip(experts, t.data, strict=True):
                if name in wanted and shape[2] % kind[1] == 0:
                    found[name] = file_blocks(raw, t.tensor_type.name, shape[1], shape[2])
            continue
        name = linear_tensor_name(t.name, config)
        if name is None or name not in wanted or len(shape) != 2 or shape[1] % kind[1]:
            continue
        blocks = file_blocks(t.data, t.tensor_type.name, *shape)
        heads = permuted_rope_heads(config, name)
        found[name] = blocks if heads is None else blocks.permuted_rows(heads)
    return found
