"""A fixed number of adapter slots over one base model: every adapter's weights live in stacked
tensors, so one step serves rows of many adapters (and of the base) with a few matmuls per
projection and slot in the step, never one per row (Punica's idea, segmented by slot).

Layout, per served projection of each layer (`SlotWeights`): A [S*R, in] and Bt [S*R, out], where
S = max_loras and R = max_lora_rank. Slot s owns rows s*R .. s*R + R; an adapter of rank r < R
fills the first r and leaves the rest zero, and a module the adapter does not target stays zero.
A step's rows are tagged with their slot (-1: the base). For each slot s with rows in the step,
its rows X_s (a slice where each slot's rows are one run, else gathered in slot order) get

    X_s @ A[s*R : s*R + r_s].T @ Bt[s*R : s*R + r_s]

added to their own output rows: two small matmuls per slot in the step and projection.

Why segmented rather than one masked product over all slots, ((x @ A.T) * mask) @ Bt: that product
reads every slot, and 0 x NaN (or 0 x inf) is NaN, so one adapter's non-finite weights (or an
overflow in its shrink) reached every other row of the step; the segmented product reads a slot's
weights only for that slot's rows. Tenant isolation holds by
construction, whatever a slot holds (validation, api/lora_manifest.py, is the other layer).

Invariants:
- A row's output depends only on its own input, the base's weights and its own slot's weights;
  base rows never touch adapter weights.
- A slot that a running sequence pins is never reloaded or evicted; a free or unpinned slot is
  taken least recently used first when a new adapter needs one.
- `AdapterBatch` is set for one forward pass and cleared after it; None means no row of the step
  has an adapter, and the projections then cost exactly the base.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.lora.adapter import AdapterError, LoraAdapter, module_shape
from inferplane.worker.quant.smooth import smoothed_factors


@dataclass
class SlotWeights:
    """One projection's stacked adapter weights (see the module docstring)."""

    a: torch.Tensor  # [S*R, in]
    bt: torch.Tensor  # [S*R, out]
    targeted: set[int] = field(default_factory=set)  # slots whose adapter targets this projection


@dataclass(frozen=True)
class SlotRows:
    """One slot's share of a forward pass: which stacked rows of A/Bt are its adapter's, and which
    of the step's rows run under it: `rows` where they are one run of the step, else positions
    `start:end` of the step's adapter rows gathered in slot order (`AdapterBatch.order`)."""

    slot: int
    stacked: slice  # slot*R .. slot*R + the adapter's rank
    rows: slice  # in the step (one run), or in the gathered rows


@dataclass
class AdapterBatch:
    """One forward pass's rows, by slot: what every wrapped projection reads.

    `order` is None where each slot's rows are one run of the step (a prefill, or one adapter's
    decode rows side by side): each slot's delta is added to its run in place. Otherwise `order`
    lists the step's adapter rows in slot order: a projection gathers x's rows once, each slot's
    delta fills its own span, and one index_add_ puts them back."""

    groups: list[SlotRows]  # per slot with rows in this step, by slot
    slots: frozenset[int]  # the slots with rows in this step
    order: torch.Tensor | None = None  # int64 [adapter rows]: their rows of the step, in slot order


@dataclass
class SlotCounters:
    loads: int = 0
    evictions: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # by adapter name


class AdapterSlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, smoothing: dict | None = None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1 to serve adapters")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        # cpu-int8's smoothing factors (quant/smooth.py): the base's projections see rescaled inputs
        # (and up_proj gives a rescaled output), so each adapter is rescaled to match when loaded.
        self.smoothing = smoothing
        self.weights: dict[tuple[int, str], SlotWeights] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, least recently used first
        self._adapter_in: list[LoraAdapter | None] = [None] * max_loras
        self._pins = [0] * max_loras
        self.counters = SlotCounters()
        self.batch: AdapterBatch | None = None

    def projection(self, layer: int, module: str) -> SlotWeights:
        """The stacked weights of one projection (made zero on first use; modules.py wraps them)."""
        key = (layer, module)
        if key not in self.weights:
            in_features, out_features = module_shape(self.config, module)
            rows = self.max_loras * self.max_rank
            self.weights[key] = SlotWeights(torch.zeros(rows, in_features, device=self.device, dtype=self.dtype),
                                            torch.zeros(rows, out_features, device=self.device, dtype=self.dtype))
        return self.weights[key]

    # -- which adapter is where --------------------------------------------------------------------

    def slot_of(self, key: str) -> int | None:
        return self._slot_of.get(key)

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """The slot holding `adapter`, loading it (into a free slot, else the least recently used
        unpinned one) if needed; None while every slot is pinned by other adapters' sequences."""
        slot = self._slot_of.get(adapter.key)
        if slot is not None:
            self._slot_of.move_to_end(adapter.key)
            return slot
        missing = [(layer, module) for layer, module in adapter.weights
                   if (layer, module) not in self.weights]
        if missing:
            layer, module = missing[0]
            raise AdapterError(f"adapter {adapter.name!r}: layer {layer} {module} is not wrapped for adapters")
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter {adapter.name!r}: rank {adapter.rank} is above max_lora_rank {self.max_rank}")
        slot = self._free_slot()
        if slot is None:
            return None
        self._write(slot, adapter)
        self._slot_of[adapter.key] = slot
        self.counters.loads += 1
        return slot

    def _free_slot(self) -> int | None:
        for slot, held in enumerate(self._adapter_in):
            if held is None:
                return slot
        for key, slot in self._slot_of.items():  # least recently used first
            if self._pins[slot] == 0:
                del self._slot_of[key]
                self._adapter_in[slot] = None
                self.counters.evictions += 1
                return slot
        return None

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for key, projection in self.weights.items():
            projection.a[rows].zero_()
            projection.bt[rows].zero_()
            projection.targeted.discard(slot)
            pair = adapter.weights.get(key)
            if pair is None:
                continue
            a, b = pair
            factor, divisor = smoothed_factors(self.smoothing, *key)
            if factor is not None:
                a = a * factor.to(a)[None, :]
            if divisor is not None:
                b = b / divisor.to(b)[:, None]
            rank = a.shape[0]
            projection.a[rows][:rank].copy_(a)
            projection.bt[rows][:rank].copy_(b.t())
            projection.targeted.add(slot)
        self._adapter_in[slot] = adapter

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise AssertionError(f"adapter slot {slot} unpinned more often than pinned")
        self._pins[slot] -= 1

    def pinned(self) -> int:
        return sum(1 for pins in self._pins if pins)

    # -- one forward pass ------------------------------------------------------------------------

    def begin(self, row_slots: list[int]) -> None:
        """Tags the next forward pass's rows with their slots (-1: the base)."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            self.batch = None
            return
        runs = all(rows[-1] - rows[0] + 1 == len(rows) for rows in by_slot.values())
        groups, order, at = [], [], 0
        for slot, rows in sorted(by_slot.items()):
            adapter = self._adapter_in[slot]
            if adapter is None:
                raise AssertionError(f"adapter slot {slot} has rows in a step but holds no adapter")
            stacked = slice(slot * self.max_rank, slot * self.max_rank + adapter.rank)
            if runs:
                groups.append(SlotRows(slot, stacked, slice(rows[0], rows[-1] + 1)))
            else:
                groups.append(SlotRows(slot, stacked, slice(at, at + len(rows))))
                order.extend(rows)
                at += len(rows)
        gathered = None if runs else torch.tensor(order, dtype=torch.long, device=self.device)
        self.batch = AdapterBatch(groups=groups, slots=frozenset(by_slot), order=gathered)

    def end(self) -> None:
        self.batch = None

    def stats(self) -> dict[str, float]:
        stats = {"lora_slots": float(self.max_loras), "lora_slots_loaded": float(len(self._slot_of)),
                 "lora_slots_pinned": float(self.pinned()), "lora_loads_total": float(self.counters.loads),
                 "lora_evictions_total": float(self.counters.evictions)}
        for name, count in self.counters.requests.items():
            stats[f"lora_requests:{name}"] = float(count)
        for adapter in self._adapter_in:
            if adapter is not None:
                stats[f"lora_loaded:{adapter.name}"] = 1.0
        return stats
