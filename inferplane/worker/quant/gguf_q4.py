"""GGUF 4-bit weights as Q4_1 blocks, straight from the file (q4_linear.Q4Linear serves them).

Q4_1 blocks are taken as they are. Q4_0 (w = d * (q - 8)) becomes Q4_1 exactly: the same d and
nibbles with the minimum m = -8 d, which float16 holds exactly (a power-of-two multiple). Q4_K
(super-blocks of 256: w = d * sc_j * q - dmin * m_j with 6-bit sc_j, m_j per block j of 32) becomes
one Q4_1 block per block j, with d * sc_j and -dmin * m_j rounded to float16 (a relative error of
at most 2^-11 on a block's scale: the nibbles are the file's). Other types (Q5_K, Q6_K, ...) are
not read here: their layers are requantized to int8 as before.
"""

from __future__ import annotations

import numpy as np
import torch

from inferplane.worker.model.config import ModelConfig
from inferplane.worker.model.gguf_file import (
    _unpermute_rope,
    linear_tensor_name,
    open_gguf,
    permuted_rope_heads,
    q4_k_nibbles,
    q4_k_scales,
)
from inferplane.worker.native import Q4_1_BLOCK, Q4_1_BYTES

Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_Q4_0_BYTES = 18  # float16 d + 16 bytes of 4-bit values
_Q4_K_VALUES = 256
_Q4_K_BYTES = 144  # float16 d, float16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values


def q4_0_to_q4_1(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """Q4_0 bytes of a [rows, cols] tensor -> Q4_1 blocks uint8 [rows, cols / 32 * 20], the same weights."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_1_BLOCK, _Q4_0_BYTES))
    d = blocks[..., :2].contiguous().view(torch.float16)
    m = (d.float() * -8).half()  # exact: a power-of-two multiple of a float16
    out = torch.cat([blocks[..., :2], m.view(torch.uint8), blocks[..., 2:]], dim=-1)
    return out.reshape(rows, -1).contiguous()


def q4_k_to_q4_1(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """Q4_K bytes of a [rows, cols] tensor -> Q4_1 blocks uint8 [rows, cols / 32 * 20] (see the module
    docstring: the same nibbles, each block's scale and minimum rounded to float16)."""
    supers = cols // _Q4_K_VALUES
    b = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, supers, _Q4_K_BYTES))
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    scales, mins = q4_k_scales(b[..., 4:16])
    block_d = (d * scales.float()).half()  # [rows, supers, 8]
    block_m = (-(dmin * mins.float())).half()
    values = q4_k_nibbles(b[..., 16:])  # [rows, supers, 8, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    head = torch.cat([block_d.unsqueeze(-1).view(torch.uint8), block_m.unsqueeze(-1).view(torch.uint8)], dim=-1)
    return torch.cat([head.reshape(rows, supers, 8, 4), packed], dim=-1).reshape(rows, -1).contiguous()


def file_q4_1_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    if type_name == "Q4_0":
        return q4_0_to_q4_1(raw, rows, cols)
    if type_name == "Q4_K":
        return q4_k_to_q4_1(raw, rows, cols)
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_1_BLOCK * Q4_1_BYTES)
                            .copy())


def load_q4_blocks(path: str, config: ModelConfig, wanted: set[str]) -> dict[str, torch.Tensor]:
    """Q4_1 blocks uint8 [rows, cols / 32 * 20] for each tensor of `wanted` (HF names) that the file
    stores as Q4_0, Q4_1 or Q4_K, rows in HF order (llama.cpp's rotary interleaving of q/k undone: it
    only permutes rows, and a row's blocks move with it)."""
    reader = open_gguf(path)
    found: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in Q4_TYPES:
            continue
        name = linear_tensor_name(t.name, config)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        unit = _Q4_K_VALUES if t.tensor_type.name == "Q4_K" else Q4_1_BLOCK
        if name is None or name not in wanted or len(shape) != 2 or shape[1] % unit:
            continue
        blocks = file_q4_1_blocks(t.data, t.tensor_type.name, *shape)
        n = permuted_rope_heads(config, name)
        if n is not None:
            blocks = _unpermute_rope(blocks, n).contiguous()
        found[name] = blocks
    return found
