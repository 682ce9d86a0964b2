"""A forward pass's token ids and positions, with the embedding and rope tables they index.

Why a class: the fused CPU decode's C call looks these up itself (native ip_decode_inputs), so a
decode step that runs wholly in C never builds x or the rope rows in PyTorch: there, an embedding
and two indexings ran with caches the previous step's weights had swept (about 0.09 ms of SmolLM2's
batch-1 step, 0.2 ms of Gemma 3's). Every other path asks for them here, computed once.

Invariant: x() and tables() are what the C lookups copy: the embedding's rows (times the multiplier
rounded to float32, Gemma's) and the rope tables' rows of the positions.
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.api.model_config import FULL, SLIDING
from inferplane.worker import native


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

    def lookups(self) -> native.DecodeInputs | None:
        """The C call's own lookups of these rows, where the sources are what it reads (a plain
        float32 embedding table, int64 ids and positions, float32 rope tables, all contiguous on the
        CPU); None otherwise. The caller keeps this object alive while the call runs."""
        emb = self.embedding
        if type(emb) is not nn.Embedding or emb.max_norm is not None:
            return None
        full = self.rotaries[FULL]
        local = self.rotaries.get(SLIDING, full)
        tables = (full.cos, full.sin, local.cos, local.sin)
        ids, positions = self.input_ids, self.positions
        if (ids.dtype != torch.int64 or positions.dtype != torch.int64 or not ids.is_contiguous()
                or not positions.is_contiguous() or ids.device.type != "cpu" or positions.device.type != "cpu"
                or not native.float32_rows(emb.weight, *tables) or full.cos.shape != local.cos.shape):
            return None
        scale = 0.0
        if self.multiplier is not None:
            scale = float(torch.tensor(self.multiplier, dtype=torch.float32))
            if scale == 0.0:  # 0.0 means "none" to the C side
                return None
        found = native.DecodeInputs(ids.data_ptr(), positions.data_ptr(), emb.weight.data_ptr(), scale)
        found.cos[0], found.signed_sin[0] = full.cos.data_ptr(), full.sin.data_ptr()
        found.cos[1], found.signed_sin[1] = local.cos.data_ptr(), local.sin.data_ptr()
        found.vocab, found.max_positions = emb.weight.shape[0], full.cos.shape[0]
        return found
