"""bench's batch-1 step split (inferplane/bench/step_split.py): it times the fused layers and the
head of a real cpu-int8 decode, and leaves the engine's objects as they were."""

from __future__ import annotations

import math

from inferplane.bench.step_split import step_split
from inferplane.worker.ops import native
from tests.worker.test_native import isa_kernels  # noqa: F401 (the fixture: kernels on this CPU)


def test_the_split_times_layers_and_head_and_restores_them(tiny_llama, isa_kernels):  # noqa: F811
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM

    llm = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    split = step_split(llm, [5, 6, 7, 8], 8)
    # Each part is a difference of two timed runs, so on a busy machine a small one (the tiny model's
    # head) can come out below zero: the test checks the split is made and adds up, not its signs.
    assert split is not None and all(math.isfinite(part) for part in (split.layers, split.head, split.rest))
    assert abs(split.total - (split.layers + split.head + split.rest)) < 1e-9
    # cpu-int8's quantized head runs in the layers' C call: the split says so and has no head of its own
    assert split.head_in_call and split.head == 0.0 and "final norm and head (one C call)" in split.describe()
    kernels = native.kernels()
    assert not {"decode_layers", "decode_steps"} & set(vars(kernels))
    assert "forward" not in vars(llm.engine.loaded.model.lm_head)
    assert llm.generate([[5, 6, 7, 8]], params)[0].token_ids == before
