"""GGUF 4-bit weights as Q4_1 blocks, straight from the file (q4_linear.Q4Linear serves them).

Q4_1 blocks are taken as they are. Q4_0 (w = d * (q - 8)) becomes Q4_1 exactly: the same d and
nibbles with the minimum m = -8 d, which float16 holds exactly (a power-of-two multiple). Other
types (Q4_K and the rest) are not read here: their layers are requantized to int8 as before.
"""

from __future__ import annotations

import numpy as np
import torch

from inferplane.worker.model.config import ModelConfig
from inferplane.worker.model.gguf_file import _unpermute_rope, hf_name, open_gguf
from inferplane.worker.native import Q4_1_BLOCK, Q4_1_BYTES

Q4_TYPES = ("Q4_0", "Q4_1")
_Q4_0_BYTES = 18  # float16 d + 16 bytes of 4-bit values


def q4_0_to_q4_1(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """Q4_0 bytes of a [rows, cols] tensor -> Q4_1 blocks uint8 [rows, cols / 32 * 20], the same weights."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_1_BLOCK, _Q4_0_BYTES))
    d = blocks[..., :2].contiguous().view(torch.float16)
    m = (d.float() * -8).half()  # exact: a power-of-two multiple of a float16
    out = torch.cat([blocks[..., :2], m.view(torch.uint8), blocks[..., 2:]], dim=-1)
    return out.reshape(rows, -1).contiguous()


def file_q4_1_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    if type_name == "Q4_0":
        return q4_0_to_q4_1(raw, rows, cols)
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_1_BLOCK * Q4_1_BYTES)
                            .copy())


def load_q4_blocks(path: str, config: ModelConfig, wanted: set[str]) -> dict[str, torch.Tensor]:
    """Q4_1 blocks uint8 [rows, cols / 32 * 20] for each tensor of `wanted` (HF names) that the file
    stores as Q4_0 or Q4_1, rows in HF order (llama.cpp's rotary interleaving of q/k undone: it
    only permutes rows, and a row's blocks move with it)."""
    reader = open_gguf(path)
    found: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in Q4_TYPES:
            continue
        name = hf_name(t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if name not in wanted or len(shape) != 2 or shape[1] % Q4_1_BLOCK:
            continue
        blocks = file_q4_1_blocks(t.data, t.tensor_type.name, *shape)
        if config.architecture in ("llama", "mistral"):
            heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
            n = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
            if n is not None:
                blocks = _unpermute_rope(blocks, n).contiguous()
        found[name] = blocks
    return found
