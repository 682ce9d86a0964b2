"""GGUF 4-bit weights served from their own blocks (quant/q4_linear.py, native ip_q4_1_linear): the
kernel on every ISA build this CPU runs against its PyTorch reference, the layout round trip, Q4_0
made Q4_1 exactly, the fused decode layer over Q4 layers, and SmolLM2's file blocks equal to the
weights the loader dequantizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferplane.worker import native
from inferplane.worker.model.gguf_file import dequantize
from inferplane.worker.quant.gguf_q4 import q4_0_to_q4_1, q4_k_to_q4_1
from inferplane.worker.quant.q4_linear import (
    Q4Linear,
    dequantize_q4_1,
    quantize_q4_1,
    reference_linear,
    scaled_q4_1,
)
from tests.worker.test_native import isa_kernels  # noqa: F401 (the fixture: every ISA build here)


def _blocks(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * torch.linspace(0.2, 2.0, in_features)
    return weight, quantize_q4_1(weight)


def test_quantize_and_dequantize_follow_q4_1():
    weight, blocks = _blocks(16, 64)
    assert blocks.shape == (16, 2 * 20) and blocks.dtype == torch.uint8
    restored = dequantize_q4_1(blocks)
    step = (weight.reshape(16, 2, 32).amax(-1) - weight.reshape(16, 2, 32).amin(-1)) / 15
    assert ((restored - weight).abs().reshape(16, 2, 32) <= step[..., None] / 2 + 1e-2).all()


def test_the_packed_layout_round_trips_and_dequantizes_exactly(isa_kernels):  # noqa: F811
    _, blocks = _blocks(48, 96, seed=1)
    packed = native.pack_q4_1(blocks)
    assert packed.shape == (3, 3, 320)
    assert torch.equal(native.unpack_q4_1(packed), blocks)
    assert torch.equal(isa_kernels.q4_1_dequantize(packed), dequantize_q4_1(blocks))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (48, 96), (128, 64)])
def test_q4_1_linear_equals_its_reference(isa_kernels, rows, out_features, in_features):  # noqa: F811
    _, blocks = _blocks(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features) * 3
    x[0, :32] = 0.0  # an all-zero input block: scale 0, no division by it
    bias = torch.randn(out_features)
    got = isa_kernels.q4_1_linear(x, native.pack_q4_1(blocks), bias)
    torch.testing.assert_close(got, reference_linear(x, blocks, bias), rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, in_features * 2)[:, :in_features]  # rows ldx apart
    torch.testing.assert_close(isa_kernels.q4_1_linear(strided, native.pack_q4_1(blocks), None),
                               reference_linear(strided, blocks, None), rtol=1e-5, atol=1e-4)


def test_q4_1_linear_is_exact_at_the_largest_sums(isa_kernels):  # noqa: F811
    """Every weight 15 (or 0) and every input 127 (or -127): the plain AVX2 build sums a block's
    vpmaddubsw pairs in int16 (at most 8 x 2 x 15 x 127 = 30480) before widening; nothing wraps."""
    weight = torch.ones(16, 64)
    weight[:, ::32] = 0.0  # each block's minimum 0 and maximum 1: q = 15 for the other 31 inputs
    blocks = quantize_q4_1(weight)
    nibbles = blocks.reshape(16, 2, 20)[..., 4:]
    assert ((nibbles & 0x0F)[..., 1:] == 15).all() and ((nibbles >> 4) == 15).all()
    for sign in (1.0, -1.0):
        x = torch.full((3, 64), sign)
        got = isa_kernels.q4_1_linear(x, native.pack_q4_1(blocks), None)
        torch.testing.assert_close(got, reference_linear(x, blocks, None), rtol=0, atol=1e-4)
        assert torch.allclose(got, torch.full((3, 16), 62.0 * sign), rtol=1e-3)


def test_q4_0_becomes_q4_1_exactly():
    gguf = pytest.importorskip("gguf")
    weight = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_0)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(dequantize_q4_1(q4_0_to_q4_1(raw, 32, 64)).numpy(), expected)


def test_q4_k_becomes_q4_1_blocks_with_the_files_nibbles():
    """Q4_K's 6-bit block scales and mins times the super-block's d and dmin, rounded to float16:
    every weight within 2^-11 of its block's largest scale and minimum terms."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    rows, cols = 8, 512
    raw = rng.integers(0, 256, size=(rows, cols // 256 * 144), dtype=np.uint8)
    for r in range(rows):
        for super_block in range(cols // 256):
            start = super_block * 144
            for offset in (0, 2):  # d and dmin: small positive float16, as quantizers write them
                value = np.float16(rng.uniform(0.001, 0.01))
                raw[r, start + offset:start + offset + 2] = np.frombuffer(value.tobytes(), np.uint8)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(dequantize("Q4_K", raw, (rows, cols)).numpy(), expected)  # the loader: exact
    got = dequantize_q4_1(q4_k_to_q4_1(raw, rows, cols)).numpy()
    bound = 2**-11 * (15 * 63 * 0.01 + 63 * 0.01)
    assert np.abs(got - expected).max() <= bound
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero tensors


def test_the_scale_test_hook_scales_every_weight():
    _, blocks = _blocks(16, 32, seed=3)
    torch.testing.assert_close(dequantize_q4_1(scaled_q4_1(blocks, 4.0)), dequantize_q4_1(blocks) * 4, rtol=1e-3,
                               atol=1e-3)


def test_a_q4_layer_switches_to_float_gemm_from_its_measured_rows(isa_kernels):  # noqa: F811
    _, blocks = _blocks(32, 64, seed=4)
    layer = Q4Linear(blocks, 64)
    x = torch.randn(8, 64)
    torch.testing.assert_close(layer(x), reference_linear(x, blocks, None), rtol=1e-5, atol=1e-4)
    layer.dispatch.set_float_from(64, 32, 4, "q4_1")
    torch.testing.assert_close(layer(x), x @ dequantize_q4_1(blocks).T, rtol=1e-5, atol=1e-4)
    assert layer.weight_bytes() == 32 * 64 * 20 // 32


def _as_q4(llm) -> int:
    """Every fused linear of the tiny model's decoder layers as a Q4Linear of its own weights."""
    from inferplane.worker.quant.int8_linear import Int8Linear

    swapped = 0
    for layer in llm.engine.loaded.model.model.layers:
        for owner, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            current = getattr(owner, attr)
            assert isinstance(current, Int8Linear)
            weight = current.dequantized_weight()
            setattr(owner, attr, Q4Linear(quantize_q4_1(weight), current.in_features, current.bias, current.dispatch))
            swapped += 1
    return swapped


def test_the_fused_decoder_layer_over_q4_layers_gives_the_op_by_op_results(tiny_llama, isa_kernels, monkeypatch):  # noqa: F811
    from inferplane.worker.llm import LLM
    from inferplane.worker.model import fused_decode
    from inferplane.worker.sampling import SamplingParams
    from tests.worker.conftest import prompts_of_lengths

    llm = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True,
              kv_manager="paged")
    assert _as_q4(llm) == 12
    prompts = prompts_of_lengths([3, 17, 40, 9], 320, seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    calls = []
    real = isa_kernels.decode_layers
    monkeypatch.setattr(isa_kernels, "decode_layers", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    fused = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert calls and max(calls) == len(prompts)
    monkeypatch.setattr(fused_decode.FusedDecode, "forward", lambda *a, **k: None)
    assert fused == [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.slow
def test_smollm2s_file_blocks_are_the_weights_the_loader_dequantizes():
    from inferplane.control_plane import registry
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.quant.gguf_q4 import load_q4_blocks

    path = str(registry.ALIASES["smollm2-135m"]())
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    weights = {n: p.detach() for n, p in loaded.model.named_parameters() if n.endswith("proj.weight")}
    blocks = load_q4_blocks(path, loaded.config, set(weights))
    assert len(blocks) == len(weights) == 210  # every linear of the packaged file is Q4_1
    for name, found in blocks.items():  # q and k rows included: llama.cpp's rotary order undone
        assert torch.equal(dequantize_q4_1(found), weights[name]), name
