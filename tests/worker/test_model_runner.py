"""ModelRunner's step plumbing: the step's int64 lists made into one tensor, and every step in
inference mode whether or not its caller's loop holds it."""

from __future__ import annotations

import torch

from inferplane.worker.engine.model_runner import _Pack
from inferplane.worker.engine.sampling import SamplingParams


def test_a_packs_parts_are_views_of_one_tensor_shaped_as_added():
    pack = _Pack()
    flat, table, empty = pack.add([1, 2, 3]), pack.add([4, 5, 6, 7], (2, 2)), pack.add([])
    last = pack.add([8])
    made = []
    tensors = pack.tensors(lambda values: made.append(values) or torch.tensor(values, dtype=torch.long))
    assert made == [[1, 2, 3, 4, 5, 6, 7, 8]]  # one tensor for every part
    assert tensors[flat].tolist() == [1, 2, 3] and tensors[table].tolist() == [[4, 5], [6, 7]]
    assert tensors[empty].numel() == 0 and tensors[last].tolist() == [8]
    assert all(t.is_contiguous() and t.dtype == torch.int64 for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_every_step_runs_in_inference_mode(tiny_llama, monkeypatch):
    """LLM.generate enters inference mode once for all its steps; a step run on its own enters it
    itself; neither leaves it on for the caller."""
    from inferplane.worker.llm import LLM

    llm = LLM(tiny_llama, runtime="paged", device="cpu", num_kv_blocks=32)
    model = llm.engine.loaded.model
    seen = []
    real = model.forward_and_logits
    monkeypatch.setattr(model, "forward_and_logits",
                        lambda *a, **k: (seen.append(torch.is_inference_mode_enabled()), real(*a, **k))[1])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], params)
    assert len(seen) == 4 and all(seen) and not torch.is_inference_mode_enabled()
    seen.clear()
    llm.engine.add_request([4, 5, 6], params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(seen) == 4 and all(seen) and not torch.is_inference_mode_enabled()
