"""cpu-int8's decode weights in one arena on huge pages (quant/weight_arena.py): the same tensors
with the same values in new memory, in the order a decode step reads them, and the same outputs."""

from __future__ import annotations

import mmap

import torch

from inferplane.worker.ops import structure
from inferplane.worker.quant.weight_arena import ALIGN, decode_operands, place
from tests.worker.conftest import prompts_of_lengths
from tests.worker.test_quant import needs_native_int8


def test_place_moves_each_tensors_storage_and_keeps_the_tensor():
    weight, codes = torch.randn(37, 5), torch.arange(100, dtype=torch.int64)
    base = torch.randn(10, 10)
    view = base[2:5]  # shares base's storage: moving it would keep two copies
    expected = [t.clone() for t in (weight, codes, view)]
    view_at, version = view.data_ptr(), structure.version()

    arena, left = place([weight, codes, view])

    assert arena is not None and left == view.numel() * view.element_size()
    for tensor, values in zip((weight, codes, view), expected, strict=True):
        assert torch.equal(tensor, values) and tensor.dtype == values.dtype and tensor.shape == values.shape
    assert view.data_ptr() == view_at
    assert arena.address % (2 * 2**20) == 0
    assert weight.data_ptr() == arena.address
    assert codes.data_ptr() == arena.address + -(-weight.numel() * 4 // ALIGN) * ALIGN  # next cache line, in order
    assert structure.version() > version  # the fused decode's raw pointers are rebuilt
    weight.add_(1.0)  # the tensor now lives in the arena's memory
    assert torch.equal(arena.bytes[:weight.numel() * 4].view(torch.float32).view(37, 5), expected[0] + 1.0)
    assert arena.advised == hasattr(mmap, "MADV_HUGEPAGE")
    assert 0 <= arena.huge_page_bytes() <= arena.nbytes
    assert place([view]) == (None, left)


def _greedy(llm, prompts):
    from inferplane.worker.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


@needs_native_int8
def test_a_cpu_int8_model_decodes_from_the_arena_as_from_its_own_tensors(tiny_llama):
    from inferplane.worker.llm import LLM

    llm = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True,
              quantize_head=True)
    model = llm.engine.loaded.model
    arena, operands = model.weight_arena, decode_operands(model)
    addresses = [t.data_ptr() for t in operands]
    assert len(operands) > 2 * len(model.model.layers)  # every layer's packed linears, then the head
    assert addresses == sorted(addresses)  # the order a decode step reads them
    assert all(arena.address <= a < arena.address + arena.nbytes for a in addresses)
    stats = llm.stats()
    assert stats["weight_bytes_arena"] == arena.nbytes >= sum(t.numel() * t.element_size() for t in operands)
    assert 0 <= stats["weight_bytes_on_huge_pages"] <= arena.nbytes
    print(f"arena {arena.nbytes / 2**20:.2f} MiB, on huge pages {stats['weight_bytes_on_huge_pages'] / 2**20:.2f} MiB")

    prompts = prompts_of_lengths([5, 12, 30], 320, seed=3)
    from_arena = _greedy(llm, prompts)
    with torch.inference_mode():
        for tensor in operands:  # each back in an ordinary allocation of its own
            own = tensor.clone()
            tensor.set_(own.untyped_storage(), 0, tensor.shape, tensor.stride())
    structure.bump()
    assert not any(arena.address <= t.data_ptr() < arena.address + arena.nbytes for t in operands)
    assert _greedy(llm, prompts) == from_arena
