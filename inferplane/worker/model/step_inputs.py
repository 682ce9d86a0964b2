"""A forward pass's token ids and positions, with the embedding and rope tables they index.

Why a class: the fused CPU decode's C call looks these up itself (native ip_decode_inputs), so a
decode step that runs wholly in C never builds x or the rope rows in PyTorch: there, an embedding
and two indexings ran with caches the previous step's weights had swept (about 0.09 ms of SmolLM2's
batch-1 step, 0.2 ms of Gemma 3's). Every other path asks for them here, computed once.

Invariant: x() and tables() are what the C lookups copy: the embedding's rows (times the multiplier
rounded to float32, Gemma's) and the rope tables' rows of the positions.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from inferplane.api.model_config import FULL, SLIDING
from inferplane.worker.ops import native


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
        CPU); None otherwise. The caller keeps this object alive while the call runs. The tables are
        checked once for each set of them (_table_lookups); a step checks its ids and positions."""
        ids, positions = self.input_ids, self.positions
        if not (ids.dtype is torch.int64 and positions.dtype is torch.int64 and ids.is_cpu and positions.is_cpu
                and ids.is_contiguous() and positions.is_contiguous()):
            return None
        tables = _table_lookups(self.embedding, self.multiplier, self.rotaries)
        if tables is None:
            return None
        found = native.DecodeInputs.from_buffer_copy(tables)
        found.token_ids, found.positions = ids.data_ptr(), positions.data_ptr()
        return found


# Per embedding module: (the tables its lookups were checked with, their DecodeInputs without ids
# and positions, or None where the C call does not read them). Weak: a dropped model drops its entry.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _table_lookups(embedding: nn.Module, multiplier: float | None,
                   rotaries: dict[str, nn.Module]) -> native.DecodeInputs | None:
    """DecodeInputs naming the embedding and rope tables (ids and positions unset), or None where the
    C call does not read them; checked once for each set of tables (the same rotaries and multiplier
    over the same storage: a reassigned tensor has another address and is checked again)."""
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
        return None
    full = rotaries[FULL]
    local = rotaries.get(SLIDING, full)
    weight = embedding.weight
    tables = (full.cos, full.sin, local.cos, local.sin)
    key = (full, local, multiplier, weight.data_ptr(), *(t.data_ptr() for t in tables))
    checked = _CHECKED.get(embedding)
    if checked is not None and checked[0] == key:
        return checked[1]
    found = None
    scale = 0.0 if multiplier is None else float(torch.tensor(multiplier, dtype=torch.float32))
    # a multiplier that rounds to 0.0 is not looked up in C: 0.0 means "none" to the C side
    if (native.float32_rows(weight, *tables) and full.cos.shape == local.cos.shape
            and (multiplier is None or scale != 0.0)):
        found = native.DecodeInputs(None, None, weight.data_ptr(), scale)
        found.cos[0], found.signed_sin[0] = full.cos.data_ptr(), full.sin.data_ptr()
        found.cos[1], found.signed_sin[1] = local.cos.data_ptr(), local.sin.data_ptr()
        found.vocab, found.max_positions = weight.shape[0], full.cos.shape[0]
    _CHECKED[embedding] = (key, found)
    return found
