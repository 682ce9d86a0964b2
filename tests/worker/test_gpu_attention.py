"""The Triton kernels of the GPU path against what they replace: the paged decode kernel
(worker/ops/gpu_attention.py) against attention written out by hand, the fused norm, rotation and SiLU
kernels (worker/ops/gpu_kernels.py) against PyTorch's ops, and the engine through all of them against
transformers.

There is no GPU here, so the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before
Triton is imported, hence a subprocess), on CPU tensors: the same kernel source a GPU compiles. The
cases cover grouped-query and plain multi-head layouts, a head size that is not a power of two, a
block size that is not one either, a float16 pool under float32 queries, sliding windows and
Gemma 2's soft-cap, contexts of one position, of less than a tile and of several tiles, and block
tables in shuffled order. tests/worker/test_cuda.py runs the same comparison on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

CASES_SCRIPT = textwrap.dedent("""
    from tests.worker.attention_reference import check_cases
    print("worst", check_cases("cpu"))
""")
FUSED_SCRIPT = textwrap.dedent("""
    from tests.worker.gpu_kernels_reference import check_kernels
    print("worst", check_kernels("cpu"))
""")


def test_kernel_matches_attention_by_hand_under_the_triton_interpreter():
    assert "worst" in _interpreted(CASES_SCRIPT)


ENGINE_SCRIPT = textwrap.dedent("""
    import sys, tempfile
    from inferplane.worker.ops import gpu_attention
    from inferplane.worker.ops import native
    native.kernels = lambda: None  # no C kernel: every decode goes through the Triton kernel
    calls = []
    kernel = gpu_attention.paged_decode_attention
    gpu_attention.paged_decode_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    from inferplane import LLM, SamplingParams
    from tests.worker.conftest import hf_greedy, prompts_of_lengths
    from tests.worker.test_architectures import VOCAB, save_family
    from tests.worker.test_decode_graphs import _with_uncaptured_graphs
    for family in ("gemma2", "qwen3"):
        path = save_family(tempfile.mkdtemp() + "/" + family, family, seed=6)
        prompts = prompts_of_lengths([3, 17, 33, 40], vocab=VOCAB, seed=11)  # past the window of 16
        expected = hf_greedy(path, prompts, 10)
        for graphs in (False, True):
            llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=3)  # 4 prompts: padded batches
            if graphs:
                _with_uncaptured_graphs(llm)
            outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            print("graphs" if graphs else "eager", [o.token_ids for o in outs] == expected, len(calls), family)
""")


def _interpreted(script: str) -> str:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (PyTorch's Linux CUDA wheels bring it)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    return done.stdout


def test_fused_kernels_match_the_pytorch_ops_under_the_triton_interpreter():
    assert "worst" in _interpreted(FUSED_SCRIPT)


def test_the_engine_through_the_triton_kernels_decodes_as_transformers_eagerly_and_from_graph_buffers():
    """Gemma 2 (windows in a pool of their own, soft-caps) and Qwen3 (query/key norms, SwiGLU)
    through the Triton kernels in the engine, as on a GPU: the same greedy tokens as transformers."""
    lines = [line.split() for line in _interpreted(ENGINE_SCRIPT).splitlines() if line.startswith(("eager", "graphs"))]
    assert [(mode, same, family) for mode, same, _, family in lines] == [
        ("eager", "True", "gemma2"), ("graphs", "True", "gemma2"), ("eager", "True", "qwen3"),
        ("graphs", "True", "qwen3")]
    calls = [int(line[2]) for line in lines]
    assert 0 < calls[0] < calls[1] < calls[2] < calls[3]  # the kernel served the decodes of every run


def test_the_kernel_applies_only_on_cuda_or_under_the_interpreter(monkeypatch):
    import torch

    from inferplane.worker.ops import gpu_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.zeros(1, 4, 16)
    cache = torch.zeros(2, 16, 2, 16)
    assert not gpu_attention.applies(q, cache)
