"""The KV tensor store: the preallocated K and V blocks every attention layer reads and writes.

Which block belongs to which sequence is the engine's business (engine/kv/); this module only holds
the tensors. A step's keys and values are written by the rotary op (rope.py), which rotates them.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """The preallocated pool: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

    Layers listed in `window_layers` (sliding-window layers whose window is shorter than the
    context) keep theirs in a second tensor, `window_data`, of `num_window_blocks` blocks, addressed
    by each sequence's window table (kv/window.py); `data` then holds the other layers only.

    With `scratch_block`, each tensor has one block more than its pool hands out: the rows a CUDA
    graph pads a decode batch with write their KV there (decode_graphs.py), never into a sequence's."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, window_layers: frozenset[int] = frozenset(),
                 num_window_blocks: int = 0, scratch_block: bool = False):
        self.full_layers = [i for i in range(num_layers) if i not in window_layers]
        self.window_layers = sorted(window_layers)
        # where each layer's K and V live: (windowed, index in its tensor)
        self._where = {layer: (False, i) for i, layer in enumerate(self.full_layers)}
        self._where.update({layer: (True, i) for i, layer in enumerate(self.window_layers)})
        tail = (block_size, num_kv_heads, head_dim)
        spare = int(scratch_block)
        self.data = torch.zeros((len(self.full_layers), 2, num_blocks + spare, *tail), dtype=dtype, device=device)
        self.window_data = (torch.zeros((len(self.window_layers), 2, num_window_blocks + spare, *tail), dtype=dtype,
                                        device=device) if self.window_layers else None)
        # the index of the scratch block in each tensor (None: no scratch block)
        self.scratch = num_blocks if scratch_block else None
        self.window_scratch = num_window_blocks if scratch_block else None
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def is_windowed(self, index: int) -> bool:
        return self._where[index][0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        windowed, i = self._where[index]
        data = self.window_data if windowed else self.data
        return data[i, 0], data[i, 1]

    def nbytes(self) -> int:
        """What the pool takes in memory, both tensors."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.window_data) if t is not None)

    def block_payload(self, block: int, window: bool = False) -> bytes:
        """Every layer's K and V of one block as bytes ([layers, 2, block_size, kv_heads, head_dim] in
        the pool's dtype): what the KV tiers store when the block leaves the pool."""
        data = self.window_data if window else self.data
        return data[:, :, block].contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def load_block(self, block: int, payload: bytes | bytearray, window: bool = False) -> None:
        """The inverse of `block_payload`: a stored block's bytes back into block `block` of the pool."""
        data = self.window_data if window else self.data
        target = data[:, :, block]
        if len(payload) != target.numel() * target.element_size():
            raise ValueError(f"payload: {len(payload)} bytes, a block of this pool is "
                             f"{target.numel() * target.element_size()}")
        writable = payload if isinstance(payload, bytearray) else bytearray(payload)  # frombuffer shares it
        stored = torch.frombuffer(writable, dtype=torch.uint8).view(target.dtype).view(target.shape)
        target.copy_(stored)

    def copy_block(self, source: int, destination: int, window: bool = False) -> None:
        """Every layer's K and V of one block into another (a fork's copy of a partly filled block)."""
        data = self.window_data if window else self.data
        data[:, :, destination].copy_(data[:, :, source])

