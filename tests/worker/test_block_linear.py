"""GGUF 4-, 5-, 6- and 8-bit weights served from their own blocks (quant/block_linear.py, native
ip_block_linear): the kernel on every ISA build this CPU runs against its PyTorch reference, the
layout round trip, every such GGUF type read as gguf-py reads it (Q4_0/1, Q5_0/1, Q6_K and Q8_0 to
the bit, the K-quants within their float16 scale rounding), fused groups of mixed widths, the fused
decode layer over such layers, and the packaged files' blocks equal to the weights the loader
dequantizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferplane.worker.model.gguf_file import dequantize
from inferplane.worker.ops import native
from inferplane.worker.quant.block_linear import BlockLinear, quantize_blocks, reference_linear
from inferplane.worker.quant.gguf_blocks import BLOCK_TYPES, Blocks, file_blocks
from tests.worker.test_native import isa_kernels  # noqa: F401 (the fixture: every ISA build here)

BITS = (4, 5, 6, 8)


def _blocks(out_features: int, in_features: int, bits: int, seed: int = 0) -> tuple[torch.Tensor, Blocks]:
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * torch.linspace(0.2, 2.0, in_features)
    return weight, quantize_blocks(weight, bits)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_and_dequantize_follow_the_block_formula(bits):
    weight, blocks = _blocks(16, 64, bits)
    assert blocks.values.shape == (16, 64) and int(blocks.values.max()) == 2**bits - 1
    restored = blocks.dequantized()
    w = weight.reshape(16, 2, 32)
    step = (w.amax(-1) - w.amin(-1)) / (2**bits - 1)
    if bits == 6:  # symmetric: the step of the block's largest half, and its int8 scale's rounding
        step = w.abs().amax(-1) / 31 * (1 + 1 / 127)
    if bits == 8:  # Q8_0: symmetric, 127 steps each side
        step = w.abs().amax(-1) / 127
    assert ((restored - weight).abs().reshape(16, 2, 32) <= step[..., None] / 2 + 1e-2).all()


@pytest.mark.parametrize("bits", BITS)
def test_the_packed_layout_round_trips_and_dequantizes_exactly(isa_kernels, bits):  # noqa: F811
    _, blocks = _blocks(48, 96, bits, seed=1)
    packed = native.pack_blocks(blocks.values, blocks.d, blocks.m, bits)
    assert packed.shape == (3, 3, native.block_group_bytes(bits))
    values, d, m = native.unpack_blocks(packed, bits)
    assert torch.equal(values, blocks.values) and torch.equal(d, blocks.d) and torch.equal(m, blocks.m)
    assert torch.equal(isa_kernels.block_dequantize(packed, bits), blocks.dequantized())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (48, 96), (128, 64)])
def test_block_linear_equals_its_reference(isa_kernels, rows, out_features, in_features, bits):  # noqa: F811
    _, blocks = _blocks(out_features, in_features, bits, seed=rows)
    packed = native.pack_blocks(blocks.values, blocks.d, blocks.m, bits)
    x = torch.randn(rows, in_features) * 3
    x[0, :32] = 0.0  # an all-zero input block: scale 0, no division by it
    bias = torch.randn(out_features)
    got = isa_kernels.block_linear(x, packed, bits, bias)
    torch.testing.assert_close(got, reference_linear(x, blocks, bias), rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, in_features * 2)[:, :in_features]  # rows ldx apart
    torch.testing.assert_close(isa_kernels.block_linear(strided, packed, bits, None),
                               reference_linear(strided, blocks, None), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", BITS)
def test_block_linear_is_exact_at_the_largest_sums(isa_kernels, bits):  # noqa: F811
    """Every value the largest (2^bits - 1, or 0) and every input 127 (or -127): the plain AVX2 build
    sums vpmaddubsw pairs in int16 (a block's eight pairs for 4 bits, 30480 at most; four for 5 bits,
    31496; one for 6, 16002; for 8 bits the low and the high nibbles apart, eight pairs each) before
    widening; nothing wraps."""
    top = 2**bits - 1
    if bits == 6:  # Q6_K's form: q = 63 with scale 1 / 31 is w = 1 (and q = 32 is 0)
        values = torch.full((16, 64), 63, dtype=torch.uint8)
        values[:, ::32] = 32
        blocks = Blocks(values, torch.full((16, 2), 1 / 31).half(), torch.ones(16, 4, dtype=torch.int8), 6)
        torch.testing.assert_close(blocks.dequantized(), torch.where(values == 63, 1.0, 0.0), rtol=1e-3, atol=0)
    else:
        weight = torch.ones(16, 64)
        weight[:, ::32] = 0.0  # each block's minimum 0 and maximum 1: q = top for the other 31 inputs
        blocks = quantize_blocks(weight, bits)
    assert (blocks.values.reshape(16, 2, 32)[..., 1:] == top).all()
    packed = native.pack_blocks(blocks.values, blocks.d, blocks.m, bits)
    for sign in (1.0, -1.0):
        x = torch.full((3, 64), sign)
        got = isa_kernels.block_linear(x, packed, bits, None)
        torch.testing.assert_close(got, reference_linear(x, blocks, None), rtol=0, atol=1e-4)
        assert torch.allclose(got, torch.full((3, 16), 62.0 * sign), rtol=1e-3)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_per_32_types_become_blocks_with_the_same_weights(type_name):
    """gguf-py quantizes, our reader turns the bytes into blocks: the weights are gguf-py's to the bit
    (Q4_0's and Q5_0's minimum -8 d or -16 d is exact in float16)."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    weight = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weight, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    blocks = file_blocks(raw, type_name, 32, 64)
    assert blocks.bits == BLOCK_TYPES[type_name][2]
    assert np.array_equal(blocks.dequantized().numpy(), expected)


def _random_k_quant(rows: int, cols: int, unit: int, seed: int) -> np.ndarray:
    """Random K-quant bytes with small positive float16 d and dmin, as quantizers write them."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256 * unit), dtype=np.uint8)
    for r in range(rows):
        for super_block in range(cols // 256):
            for offset in (0, 2):
                value = np.float16(rng.uniform(0.001, 0.01))
                at = super_block * unit + offset
                raw[r, at:at + 2] = np.frombuffer(value.tobytes(), np.uint8)
    return raw


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_the_k_quants_become_blocks_with_the_files_values(type_name):
    """Q4_K's and Q5_K's 6-bit block scales and mins times the super-block's d and dmin, rounded to
    float16: every weight within 2^-11 of its block's largest scale and minimum terms."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    unit, _, bits = BLOCK_TYPES[type_name]
    rows, cols = 8, 512
    raw = _random_k_quant(rows, cols, unit, seed=bits)
    expected = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(dequantize(type_name, raw, (rows, cols)).numpy(), expected)  # the loader: exact
    blocks = file_blocks(raw, type_name, rows, cols)
    assert blocks.bits == bits and int(blocks.values.max()) == 2**bits - 1
    bound = 2**-11 * ((2**bits - 1) * 63 * 0.01 + 63 * 0.01)
    assert np.abs(blocks.dequantized().numpy() - expected).max() <= bound
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero tensors


def _random_q6_k(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    d = rng.uniform(0.0001, 0.001, size=(rows, cols // 256)).astype(np.float16)
    raw[..., 208:210] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def test_q6_k_becomes_blocks_with_the_same_weights(isa_kernels):  # noqa: F811
    """Q6_K keeps its form (values, half-block scales, d): the weights are gguf-py's to the bit, in
    PyTorch and in the kernel's dequantize."""
    gguf = pytest.importorskip("gguf")
    rows, cols = 16, 512
    raw = _random_q6_k(rows, cols, seed=6)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    assert np.array_equal(dequantize("Q6_K", raw, (rows, cols)).numpy(), expected)  # the loader: exact
    blocks = file_blocks(raw, "Q6_K", rows, cols)
    assert blocks.bits == 6 and int(blocks.values.max()) == 63 and blocks.m.dtype == torch.int8
    assert np.array_equal(blocks.dequantized().numpy(), expected)
    packed = native.pack_blocks(blocks.values, blocks.d, blocks.m, 6)
    assert np.array_equal(isa_kernels.block_dequantize(packed, 6).numpy(), expected)
    assert np.abs(expected).max() > 1.0


def test_fused_rows_of_4_and_5_bits_are_one_5_bit_layer_with_the_same_weights():
    _, four = _blocks(16, 64, 4, seed=2)
    _, five = _blocks(32, 64, 5, seed=3)
    both = Blocks.stacked([four, five])
    assert both.bits == 5
    assert torch.equal(both.dequantized(), torch.cat([four.dequantized(), five.dequantized()]))
    _, six = _blocks(16, 64, 6, seed=4)
    assert Blocks.stacked([four, six]) is None  # other formulas: such a group stays int8
    assert Blocks.stacked([six, six]).bits == 6


def test_symmetric_blocks_join_a_q8_0_group_in_its_form_and_others_keep_it_int8():
    """Gemma 3's Q4_K_M file fuses Q5_0 q and k with a Q8_0 v: one 8-bit layer with the file's weights
    (Q5_0's values moved up by 112). Q4_1's own minimums or Q6_K's form cannot join it."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(5)

    def from_gguf(type_name: str, rows: int) -> Blocks:
        raw = gguf.quants.quantize(rng.standard_normal((rows, 64)).astype(np.float32),
                                   gguf.GGMLQuantizationType[type_name])
        return file_blocks(raw, type_name, rows, 64)

    q5_0, q4_0, q8_0 = from_gguf("Q5_0", 32), from_gguf("Q4_0", 16), from_gguf("Q8_0", 16)
    group = Blocks.stacked([q5_0, q4_0, q8_0])
    assert group.bits == 8
    assert torch.equal(group.dequantized(), torch.cat([q5_0.dequantized(), q4_0.dequantized(), q8_0.dequantized()]))
    packed = native.pack_blocks(group.values, group.d, group.m, 8)
    assert packed.shape[-1] == native.block_group_bytes(8) == 544  # d alone: m is -128 d
    assert Blocks.stacked([from_gguf("Q4_1", 16), q8_0]) is None
    assert Blocks.stacked([_blocks(16, 64, 6)[1], q8_0]) is None
    with pytest.raises(ValueError, match="m must be -128 d"):
        native.pack_blocks(q5_0.values, q5_0.d, q5_0.m, 8)


@pytest.mark.parametrize("bits", BITS)
def test_the_scale_test_hook_scales_every_weight(bits):
    _, blocks = _blocks(16, 32, bits, seed=3)
    torch.testing.assert_close(blocks.scaled(4.0).dequantized(), blocks.dequantized() * 4, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bits", BITS)
def test_a_block_layer_switches_to_float_gemm_from_its_measured_rows(isa_kernels, bits):  # noqa: F811
    _, blocks = _blocks(32, 64, bits, seed=4)
    layer = BlockLinear(blocks)
    assert layer.kind == native.BLOCK_KINDS[bits]
    x = torch.randn(8, 64)
    torch.testing.assert_close(layer(x), reference_linear(x, blocks, None), rtol=1e-5, atol=1e-4)
    layer.dispatch.set_float_from(64, 32, 4, layer.kind)
    torch.testing.assert_close(layer(x), x @ blocks.dequantized().T, rtol=1e-5, atol=1e-4)
    assert layer.weight_bytes() == 32 * 64 // 32 * native.block_group_bytes(bits) // 16


def _as_blocks(llm) -> int:
    """Every fused linear of the tiny model's decoder layers as a BlockLinear of its own weights:
    5 bits for q/k/v, 6 for o, 4 and 8 for the MLP (the fused kernel reads each linear's own width)."""
    from inferplane.worker.quant.int8_linear import Int8Linear

    swapped = 0
    for layer in llm.engine.loaded.model.model.layers:
        for owner, attr, bits in ((layer.self_attn, "qkv_proj", 5), (layer.self_attn, "o_proj", 6),
                                  (layer.mlp, "gate_up_proj", 4), (layer.mlp, "down_proj", 8)):
            current = getattr(owner, attr)
            assert isinstance(current, Int8Linear)
            blocks = quantize_blocks(current.dequantized_weight(), bits)
            setattr(owner, attr, BlockLinear(blocks, current.bias, current.dispatch))
            swapped += 1
    return swapped


def test_the_fused_decoder_layer_over_block_layers_gives_the_op_by_op_results(tiny_llama, isa_kernels,  # noqa: F811
                                                                               monkeypatch):
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM
    from inferplane.worker.ops import fused_decode
    from tests.worker.conftest import prompts_of_lengths

    llm = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True,
              kv_manager="paged")
    assert _as_blocks(llm) == 12
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
    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.quant.gguf_blocks import load_blocks

    path = str(builtin_model_path("smollm2-135m"))
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    weights = {n: p.detach() for n, p in loaded.model.named_parameters() if n.endswith("proj.weight")}
    blocks = load_blocks(path, loaded.config, set(weights))
    assert len(blocks) == len(weights) == 210  # every linear of the packaged file is Q4_1
    for name, found in blocks.items():  # q and k rows included: llama.cpp's rotary order undone
        assert found.bits == 4 and torch.equal(found.dequantized(), weights[name]), name
