"""Tenant isolation between LoRA adapter slots: a row's result never depends on another slot's values.

Validation refuses non-finite weights at registration and at load (tests/api/test_lora_manifest.py);
these tests are the other layer of defence. They write NaN or infinity straight into one slot's
stacked tensors (bypassing validation, as a bug or a bit flip would) and hold every other row of a
step (the base's and other adapters') to exactly what it gives without that slot loaded: each slot's
delta reads only that slot's rows of the stacked weights, so 0 x NaN never reaches a neighbour.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from inferplane import LLM, SamplingParams
from inferplane.api.model_config import read_model_config
from inferplane.bench.lora import write_random_adapter
from inferplane.worker.lora import AdapterSlots, LoraRequest, load_adapter
from inferplane.worker.lora.modules import AdapterProjection
from tests.worker.conftest import prompts_of_lengths

RANK = 8
POISONS = [("bt", math.nan), ("a", math.inf), ("both", -math.inf), ("a", math.nan)]


def _poison(slots: AdapterSlots, slot: int, where: str, value: float) -> None:
    """Writes `value` into every stacked row of `slot` (A, Bt or both), and marks the slot as
    targeting every projection, as an adapter with such weights would."""
    rows = slice(slot * slots.max_rank, (slot + 1) * slots.max_rank)
    for weights in slots.weights.values():
        if where in ("a", "both"):
            weights.a[rows] = value
        if where in ("bt", "both"):
            weights.bt[rows] = value
        weights.targeted.add(slot)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Three adapters over the tiny base (every served module, strong enough to change tokens)."""
    config = read_model_config(tiny_llama)
    root = tmp_path_factory.mktemp("isolation")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return config, [str(write_random_adapter(root / f"a{i}", config, RANK, targets, seed=10 + i, b_scale=0.3))
                    for i in range(3)]


def _projection(config, slots: AdapterSlots) -> AdapterProjection:
    """A fused q/k/v projection (three parts side by side), as cpu-int8's converted layers have."""
    from inferplane.worker.lora.adapter import module_shape

    widths = [module_shape(config, m)[1] for m in ("q_proj", "k_proj", "v_proj")]
    torch.manual_seed(0)
    base = nn.Linear(config.hidden_size, sum(widths), bias=False)
    parts, offset = [], 0
    for module, width in zip(("q_proj", "k_proj", "v_proj"), widths, strict=True):
        parts.append((offset, slots.projection(0, module)))
        offset += width
    return AdapterProjection(base, parts, slots)


@pytest.mark.parametrize("where,value", POISONS)
@pytest.mark.parametrize("bad_slot", [0, 1, 3])
def test_a_poisoned_slot_never_reaches_other_rows_of_a_projection(adapters, where, value, bad_slot):
    """Rows of the base and of adapters in the other slots give bit for bit what they give with the
    poisoned slot empty, whether that slot has rows in the step or not, below or above the others."""
    config, folders = adapters
    slots = AdapterSlots(config, max_loras=4, max_rank=16, device=torch.device("cpu"), dtype=torch.float32)
    projection = _projection(config, slots)
    good = [load_adapter(LoraRequest(f"a{i}", folders[i]), config, 16) for i in (0, 1)]
    good_slots = [s for s in range(4) if s != bad_slot][:2]
    for adapter, slot in zip(good, good_slots, strict=True):
        slots._write(slot, adapter)  # the slot the test names, whatever acquire would pick
    slots._write(bad_slot, load_adapter(LoraRequest("bad", folders[2]), config, 16))
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(1))
    tags = [-1, good_slots[0], good_slots[1], -1, good_slots[0], good_slots[1], -1]
    with torch.inference_mode():
        slots.begin(tags)
        clean = projection(x).clone()
        running = tags + [bad_slot, bad_slot]  # the poisoned slot with rows of its own in the step
        slots.begin(running)
        # Nine rows, before the poison: the base GEMM's blocking may differ with the row count (on
        # AVX2 it does), so the rows beside the poisoned ones are held to this, not to `clean`.
        clean_running = projection(torch.cat([x, x[:2]])).clone()
        assert torch.isfinite(clean_running).all()
        _poison(slots, bad_slot, where, value)
        slots.begin(tags)  # the poisoned slot has no rows
        assert torch.equal(projection(x), clean)
        slots.begin(running)  # and with its own rows in the step
        out = projection(torch.cat([x, x[:2]]))
        slots.end()
    assert torch.isfinite(clean).all()
    assert torch.equal(out[:7], clean_running[:7])


def _run(llm: LLM, prompts, requests, salt: str, logprobs: bool = True):
    """Each run under its own cache salt: no prefix-cache hit makes one run's steps differ from another's."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1 if logprobs else None)
    return llm.generate(prompts, params, cache_salt=salt, lora_request=requests)


@pytest.mark.parametrize("where,value", POISONS[:2])
def test_an_adapter_with_non_finite_weights_in_a_slot_leaves_other_tenants_rows_as_they_were(
        tiny_llama, adapters, where, value):
    """End to end (the engine's steps, greedy tokens and logprobs): a slot holding non-finite
    weights (loaded, idle; then running beside them) changes nothing for the base's rows and another
    adapter's rows in the same steps."""
    config, folders = adapters
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_loras=3, max_lora_rank=RANK)
    prompts = prompts_of_lengths([5, 11, 17, 8], vocab=320, seed=5)
    other, bad_request = LoraRequest("other", folders[0]), LoraRequest("bad", folders[2])
    which = [None, other, None, other]
    bad = load_adapter(bad_request, config, RANK)
    slot = llm.engine.adapters.acquire(bad)  # slot 0: below the other adapter's, read by every step
    assert slot == 0
    before = _run(llm, prompts, which, "before")
    assert all(math.isfinite(lp) for out in before for lp in out.logprobs)
    _poison(llm.engine.adapters, slot, where, value)
    idle = _run(llm, prompts, which, "idle")
    assert [o.token_ids for o in idle] == [o.token_ids for o in before]
    # (logprobs to rounding: a kernel chosen by a timing may differ from one run to the next)
    assert [o.logprobs for o in idle] == [pytest.approx(o.logprobs, abs=1e-4) for o in before]
    # its own rows run beside them (from the poisoned slot): theirs are its own business
    beside = _run(llm, prompts + prompts[:2], which + [bad_request] * 2, "beside", logprobs=False)
    assert llm.engine.adapters.slot_of(bad.key) == slot and llm.stats()["lora_loads_total"] == 2
    assert [o.token_ids for o in beside[:4]] == [o.token_ids for o in before]
