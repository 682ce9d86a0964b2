"""The weights a CPU decode step reads, moved into one block of memory on huge pages, in the order
the step reads them.

Why: a batch-1 decode step streams every weight from memory once per token, so its speed is the
read bandwidth the kernels reach. Measured on this project's 2-core AMD EPYC (SmolLM2's 30 layers of
4-bit blocks, one token at a time): the block kernel read weights on ordinary 4 KiB pages at 19-22
GB/s with two threads, and the same weights on 2 MiB pages at 28-34 GB/s. Each 4 KiB page costs a
TLB miss and restarts the hardware prefetcher's stream; a 2 MiB page does not. PyTorch allocates
each tensor on its own small pages, so the packed weights are copied here once, after conversion.

Invariants:
- Every placed tensor keeps its identity, dtype, shape, strides and values; only its storage moves
  (`Tensor.set_`), so modules, the op-by-op path and the start-up cache see the same tensors. The
  raw pointers move, so the structure version is bumped and the fused decode's plan is rebuilt.
- Only tensors that own their whole storage are moved: a view shares its storage with another
  tensor, which would keep the old copy alive beside the new one.
- Huge pages are asked for (madvise), never required: where the kernel's transparent huge pages are
  off, the arena is ordinary pages, and the figure `weight_bytes_on_huge_pages` says how much the
  kernel actually backed with huge pages.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn

from inferplane.worker.ops import structure

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # a cache line: every tensor starts on one


def decode_operands(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the C kernels read for each decode step, in the order a step reads them: each
    module's fused operands (weights, scales, biases) in registration order, which is a decoder
    layer's q/k/v, o, gate/up and down linears, layer after layer, then the output head."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        operands = getattr(type(module), "fused_operands", None)
        for tensor in (operands(module) or ()) if operands else ():
            if tensor is not None:
                found.setdefault(id(tensor), tensor)
    return list(found.values())


def _movable(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.storage_offset() == 0
            and storage.nbytes() == tensor.nbytes)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class WeightArena:
    """One anonymous mapping, 2 MiB-aligned and advised for huge pages, holding tensors back to back."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.span = _round_up(max(nbytes, 1), HUGE_PAGE)
        # private: an anonymous shared mapping is shmem, whose huge pages follow another setting (often off)
        self._map = mmap.mmap(-1, self.span + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        mapped_at = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._start = -mapped_at % HUGE_PAGE  # a multiple of the base page: mapped_at is page-aligned
        self.address = mapped_at + self._start
        self.advised = False
        advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if advice is not None:
            try:
                self._map.madvise(advice, self._start, self.span)
                self.advised = True
            except OSError:  # a kernel without transparent huge pages: ordinary pages
                pass
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=self._start)

    def huge_page_bytes(self) -> int:
        """How many of the arena's bytes the kernel backs with huge pages now (/proc/self/smaps)."""
        total, inside = 0, False
        end = self.address + self.span
        try:
            with open("/proc/self/smaps") as smaps:
                for line in smaps:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):
                        lo, hi = (int(part, 16) for part in head.split("-"))
                        inside = lo < end and hi > self.address
                    elif inside and head == "AnonHugePages:":
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return min(total, self.nbytes)


def place(tensors: Iterable[torch.Tensor]) -> tuple[WeightArena | None, int]:
    """Moves the movable tensors into one new arena, in the given order; returns it (None when
    nothing moved) and the bytes of tensors left where they were."""
    movable, left = [], 0
    for tensor in tensors:
        if _movable(tensor):
            movable.append(tensor)
        else:
            left += tensor.nbytes
    if not movable:
        return None, left
    offsets, end = [], 0
    for tensor in movable:
        offset = _round_up(end, ALIGN)
        offsets.append(offset)
        end = offset + tensor.nbytes
    arena = WeightArena(end)
    for tensor, offset in zip(movable, offsets, strict=True):
        size = tensor.nbytes
        view = arena.bytes[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        with torch.inference_mode() if tensor.is_inference() else nullcontext(), torch.no_grad():
            view.copy_(tensor)
            tensor.set_(view.untyped_storage(), view.storage_offset(), tensor.shape, tensor.stride())
    structure.bump()  # every moved tensor's pointer changed
    return arena, left


def place_decode_weights(model: nn.Module) -> dict[str, float]:
    """Moves the model's decode operands into one huge-page arena (kept on the model, which owns the
    memory from then on); returns the figures for stats: bytes placed, bytes on huge pages."""
    arena, _ = place(decode_operands(model))
    if arena is None:
        return {}
    model.weight_arena = arena
    return {"weight_bytes_arena": float(arena.nbytes), "weight_bytes_on_huge_pages": float(arena.huge_page_bytes())}
