"""A forward pass's token ids and positions, with the embedding and rope tables they index.

Why a class: the fused CPU decode's C call looks these up itself (ops/fused_decode.py's
decode_inputs), so a decode step that runs wholly in C never builds x or the rope rows in PyTorch:
there, an embedding and two indexings ran with caches the previous step's weights had swept (about
0.09 ms of SmolLM2's batch-1 step, 0.2 ms of Gemma 3's). Every other path asks for them here,
computed once.

Invariant: x() and tables() are what the C lookups copy: the embedding's rows (times the multiplier
rounded to float32, Gemma's) and the rope tables' rows of the positions.
"""

from __future__ import annotations

import torch
from torch import nn


class StepInputs:
    """Token ids [T] and positions [T] (int64), the model's embedding, its multiplier (or None) and
    its rotaries by rope kind (FULL, and SLIDING where the sliding layers have their own)."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, embedding: nn.Module,
                 multiplier: float | None, rotaries: dict[str, nn.Module]):
        self.input_ids = input_ids
        self.positions = positions
        self.embedding = embedding
        self.multiplier = multiplier
        self.rotaries = rotaries
        self._x: torch.Tensor | None = None
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def x(self) -> torch.Tensor:
        """The embedded rows [T, hidden], times the multiplier where there is one."""
        if self._x is None:
            x = self.embedding(self.input_ids)
            if self.multiplier is not None:  # Gemma: the scale rounded to the compute dtype
                x = x * torch.tensor(self.multiplier, dtype=x.dtype)
            self._x = x
        return self._x

    def tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin of each position [T, 1, head_dim], by rope kind."""
        if self._tables is None:
            dtype = self._x.dtype if self._x is not None else self.embedding.weight.dtype
            self._tables = {kind: rotary(self.positions, dtype) for kind, rotary in self.rotaries.items()}
        return self._tables
