"""Per-channel int8 straight from GGUF Q8_0 blocks.

A Q8_0 tensor is already int8: blocks of 32 values with one float16 scale each. Requantizing to one
scale per output row keeps those values where a block holds its row's largest magnitude and rescales
the others, instead of going through a float32 copy of the whole tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.model.gguf_file import _unpermute_rope, linear_tensor_name, open_gguf, permuted_rope_heads
from inferplane.worker.quant.int8_linear import QMAX

_BLOCK = 32
_BLOCK_BYTES = 34  # float16 scale + 32 int8
_ROWS_PER_CHUNK = 4096  # bounds the float32 scratch to a few MB whatever the tensor size


def q8_0_to_per_channel(raw: np.ndarray, shape: tuple[int, int],
                        scale_multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes of a [rows, cols] tensor -> (int8 [rows, cols], float32 scale [rows])."""
    rows, cols = shape
    if cols % _BLOCK:
        raise ValueError(f"Q8_0 rows must be a multiple of {_BLOCK} values, got {cols}")
    # Memory-mapped and read-only: chunks are copied out one at a time.
    blocks = np.asarray(raw).view(np.uint8).reshape(rows, cols // _BLOCK, _BLOCK_BYTES)
    q_out = torch.empty(rows, cols, dtype=torch.int8)
    scale_out = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = torch.from_numpy(blocks[start : start + _ROWS_PER_CHUNK].copy())
        d = chunk[..., :2].contiguous().view(torch.float16).float()  # [r, nb, 1]
        q = chunk[..., 2:].contiguous().view(torch.int8)  # [r, nb, 32]
        block_max = q.abs().amax(dim=-1, keepdim=True).float() * d.abs()  # largest |w| per block
        scale = (block_max.amax(dim=1, keepdim=True) / QMAX).clamp(min=torch.finfo(torch.float32).tiny)
        requant = torch.round(q.float() * (d / scale)).clamp_(-QMAX, QMAX).to(torch.int8)
        n = chunk.shape[0]
        q_out[start : start + n] = requant.reshape(n, cols)
        scale_out[start : start + n] = scale.reshape(n)
    return q_out, scale_out * scale_multiplier


def load_q8_0_linears(path: str, config: ModelConfig, wanted: set[str],
                      scale_multiplier: float = 1.0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(int8, scale) for each tensor of `wanted` (HF names) that the GGUF file stores as Q8_0.

    Rows come out in HF order: llama.cpp's interleaving of q/k rotary rows is undone on the int8
    rows and their scales alike, since it only permutes rows.
    """
    reader = open_gguf(path)
    found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in reader.tensors:
        if t.tensor_type.name != "Q8_0":
            continue
        name = linear_tensor_name(t.name, config)
        if name is None or name not in wanted:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if len(shape) != 2:
            continue
        q, scale = q8_0_to_per_channel(t.data, shape, scale_multiplier)
        n = permuted_rope_heads(config, name)
        if n is not None:
            q, scale = _unpermute_rope(q, n), _unpermute_rope(scale, n)
        found[name] = (q.contiguous(), scale.contiguous())
    return found
