"""int8 weights for the cpu-int8 runtime: the layer's error bounds, the Q8_0 path, the conversion
and the gate's arithmetic, on random tensors and the tiny test checkpoints (fast)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from inferplane.worker.ops import native
from inferplane.worker.quant.gate import GateAccumulator, load_eval_text, windows
from inferplane.worker.quant.gguf_q8 import q8_0_to_per_channel
from inferplane.worker.quant.int8_linear import (
    Int8Dispatch,
    Int8Linear,
    dynamic_error_bound,
    quantize_per_channel,
    weight_only_error_bound,
)
from tests.worker.conftest import prompts_of_lengths

_NATIVE_INT8 = native.kernels() is not None and native.kernels().has_int8_linear
needs_native_int8 = pytest.mark.skipif(not _NATIVE_INT8, reason="no C compiler (or not x86-64) here")


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        layer.weight[:, 3] *= 8  # an input channel with large weights, as real models have
    return layer


def _inputs(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, 5] *= 8  # an outlier activation channel: the hard case for per-token int8
    return x


def test_per_channel_rounding_is_within_half_a_step():
    w = _linear(96, 40, bias=False).weight.detach()
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    assert int(q.abs().max()) == 127  # each row uses the whole range
    err = (w - q.float() * scale[:, None]).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dynamic_path_is_within_its_scale_bound(rows, bias):
    linear = _linear(96, 40, bias)
    layer = Int8Linear.from_linear(linear)
    x = _inputs(rows, 96)
    ref = linear(x).detach()
    err = (layer.forward_dynamic(x) - ref).abs()
    bound = dynamic_error_bound(layer, x)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # it is int8, not a float copy


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_weight_only_path_is_within_its_scale_bound(rows):
    linear = _linear(96, 40, bias=True)
    layer = Int8Linear.from_linear(linear)
    x = _inputs(rows, 96)
    ref = linear(x).detach()
    err = (layer.forward_weight_only(x) - ref).abs()
    assert bool((err <= weight_only_error_bound(layer, x)).all())


@needs_native_int8
@pytest.mark.parametrize("rows", [1, 7, 16, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_path_is_within_the_dynamic_bound_and_keeps_the_bytes(rows, bias):
    linear = _linear(96, 48, bias)
    layer = Int8Linear.from_linear(linear)
    x = _inputs(rows, 96)
    bound, dynamic, plain_bytes = dynamic_error_bound(layer, x), layer.forward_dynamic(x), layer.weight_bytes()
    weight = layer.dequantized_weight()
    assert layer.pack() and layer.is_packed and layer.qweight is None
    out = layer(x)
    assert bool(((out - linear(x).detach()).abs() <= bound).all())
    torch.testing.assert_close(out, dynamic, rtol=1e-6, atol=1e-6)  # the same int8 product, other kernel
    assert layer.weight_bytes() == plain_bytes
    assert torch.equal(layer.dequantized_weight(), weight)
    with pytest.raises(ValueError, match="packed"):
        layer.forward_dynamic(x)


def test_a_shape_the_packed_layout_cannot_hold_stays_unpacked():
    layer = Int8Linear.from_linear(_linear(96, 40, bias=False))  # 40 outputs: not a multiple of 16
    assert not layer.pack() and not layer.is_packed and layer.qweight is not None


def test_wrong_scales_break_the_bound():
    """The bound tests above can fail: scales 50% off put outputs outside the bound."""
    linear = _linear(96, 40, bias=False)
    layer = Int8Linear.from_linear(linear, scale_multiplier=1.5)
    x = _inputs(8, 96)
    ref = linear(x).detach()
    assert bool(((layer.forward_dynamic(x) - ref).abs() > dynamic_error_bound(layer, x)).any())
    assert bool(((layer.forward_weight_only(x) - ref).abs() > weight_only_error_bound(layer, x)).any())


def test_dispatch_picks_the_kernel_by_row_count():
    layer = Int8Linear.from_linear(_linear(64, 32, bias=False), Int8Dispatch(default_min_rows=4))
    small, large = _inputs(3, 64), _inputs(4, 64)
    assert torch.equal(layer(small), layer.forward_weight_only(small))
    assert torch.equal(layer(large), layer.forward_dynamic(large))
    layer.dispatch.set(64, 32, 1)
    assert torch.equal(layer(small), layer.forward_dynamic(small))
    batched = _inputs(6, 64).reshape(2, 3, 64)  # leading dims are flattened into rows
    assert layer(batched).shape == (2, 3, 32)


def test_calibration_sets_a_threshold_per_shape():
    from inferplane.worker.quant.dispatch import ROW_COUNTS, calibrate

    dispatch = Int8Dispatch()
    shapes = [(64, 32), (64, 32), (32, 128)]
    layers = [Int8Linear.from_linear(_linear(k, n, False), dispatch) for k, n in shapes]
    thresholds = calibrate(layers, dispatch, reps=1)
    assert set(thresholds) == {(64, 32), (32, 128)}
    assert all(t in (*ROW_COUNTS, ROW_COUNTS[-1] * 2) for t in thresholds.values())


def _q8_0_bytes(w: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 encoding: per block of 32, d = max|w| / 127 (float16), q = round(w / d)."""
    blocks = w.reshape(-1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / 127).astype(np.float16)
    q = np.round(blocks / np.where(d == 0, 1, d.astype(np.float32))).clip(-127, 127).astype(np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1).reshape(-1)


def test_q8_0_blocks_become_per_channel_int8():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, size=(6, 128)).astype(np.float32)
    w[2, 70] = 0.5  # one block of row 2 holds a much larger value than the rest
    raw = _q8_0_bytes(w)
    q, scale = q8_0_to_per_channel(raw, (6, 128))
    blocks = raw.reshape(6, 4, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    block_q = blocks[..., 2:].copy().view(np.int8)
    dequant = torch.from_numpy((block_q.astype(np.float32) * d).reshape(6, 128))
    # Same rounding as quantizing the dequantized tensor, up to one step at ties.
    q_ref, scale_ref = quantize_per_channel(dequant)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1
    # The block that holds its row's maximum keeps its int8 values exactly.
    assert torch.equal(q[2, 64:96], torch.from_numpy(block_q[2, 2]))
    assert float((q.float() * scale[:, None] - dequant).abs().max()) <= float(scale.max()) / 2 * 1.001


def test_gate_figures():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(9, 50, generator=gen) * 3
    ids = torch.randint(0, 50, (9,), generator=gen).tolist()
    same = GateAccumulator()
    same.add(ref, ref.clone(), ids)
    r = same.result()
    assert r.tokens == 8 and abs(r.ppl_rise_pct) < 1e-6 and r.top1_agreement == 1.0 and abs(r.kl_mean) < 1e-6
    assert r.passed
    noisy = GateAccumulator()
    noisy.add(ref, ref + torch.randn(9, 50, generator=gen) * 3, ids)
    r = noisy.result(threshold_pct=2.0)
    assert r.kl_mean > 0.1 and r.top1_agreement < 1.0
    assert r.passed == (r.ppl_rise_pct <= 2.0)
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone token predicts nothing


def test_eval_text_has_its_source_and_no_header():
    from importlib import resources

    raw = resources.files("inferplane.worker.quant").joinpath("data/eval_text.txt").read_text("utf-8")
    assert "Source:" in raw.splitlines()[1] and "public domain" in raw
    text = load_eval_text()
    assert not text.startswith("#") and text.startswith("Chapter 37")
    assert len(text.split()) > 4000


def test_cli_parser_does_not_import_torch():
    code = ("import argparse, sys; from inferplane.worker.quant import cli; "
            "cli.configure(argparse.ArgumentParser()); sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- conversion on the tiny checkpoint -----------------------------------------------------------------


def _tiny(path):
    from inferplane.worker.model.loader import load_model

    return load_model(path, torch.device("cpu"), torch.float32)


def test_smoothing_leaves_the_float_model_unchanged(tiny_llama):
    from inferplane.worker.quant.gate import sequence_logits
    from inferplane.worker.quant.smooth import input_absmax, smooth_llama

    loaded = _tiny(tiny_llama)
    ids = prompts_of_lengths([40], loaded.config.vocab_size)[0]
    before = sequence_logits(loaded.model, ids)
    norm_before = loaded.model.model.layers[0].input_layernorm.weight.detach().clone()
    assert smooth_llama(loaded.model, input_absmax(loaded.model, ids), alpha=0.5) == loaded.config.num_layers
    assert not torch.equal(loaded.model.model.layers[0].input_layernorm.weight, norm_before)
    torch.testing.assert_close(sequence_logits(loaded.model, ids), before, rtol=1e-4, atol=1e-4)


def test_convert_fuses_and_replaces_every_linear(tiny_llama):
    from inferplane.worker.quant.convert import convert_model

    loaded = _tiny(tiny_llama)
    report = convert_model(loaded.model, measure_dispatch=False)
    model = loaded.model
    assert not any(isinstance(m, nn.Linear) for n, m in model.named_modules() if n != "lm_head")
    assert isinstance(model.lm_head, nn.Linear)  # the head stays float by default
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int8Linear) and not hasattr(attn, "q_proj")
    assert len(report.layers) == 4 * loaded.config.num_layers
    assert report.int8_bytes <= 0.3 * report.float_bytes

    head = _tiny(tiny_llama)
    convert_model(head.model, quantize_head=True, measure_dispatch=False)
    assert isinstance(head.model.lm_head, Int8Linear)
    assert isinstance(head.model.model.embed_tokens, nn.Embedding)


def test_a_snapshot_restores_the_same_model_and_a_wrong_one_changes_nothing(tiny_llama):
    from inferplane.worker.quant.convert import calibration_tokens, convert_model, restore, snapshot
    from inferplane.worker.quant.gate import sequence_logits

    converted = _tiny(tiny_llama)
    report = convert_model(converted.model, calibration_ids=calibration_tokens(converted), measure_dispatch=False)
    saved = snapshot(converted.model, report)
    ids = prompts_of_lengths([30], converted.config.vocab_size)[0]

    fresh = _tiny(tiny_llama)
    wrong = {**saved, "layers": saved["layers"][:-1]}
    float_logits = sequence_logits(fresh.model, ids)
    with pytest.raises(ValueError, match="int8 layers"):
        restore(fresh.model, wrong)
    torch.testing.assert_close(sequence_logits(fresh.model, ids), float_logits, rtol=0, atol=0)  # untouched
    restored = restore(fresh.model, saved, measure_dispatch=False)
    assert len(restored.layers) == len(report.layers) and restored.source_layers == report.source_layers
    torch.testing.assert_close(sequence_logits(fresh.model, ids), sequence_logits(converted.model, ids),
                               rtol=0, atol=0)
    # the smoothing factors come back too (LoRA adapters are rescaled by them), through the file's
    # own loader (weights_only), as the start-up cache reads it
    import io

    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    again = _tiny(tiny_llama)
    restore(again.model, torch.load(buffer, weights_only=True), measure_dispatch=False)
    assert converted.model.smoothing and again.model.smoothing.keys() == converted.model.smoothing.keys()
    for key, factor in converted.model.smoothing.items():
        torch.testing.assert_close(again.model.smoothing[key], factor, rtol=0, atol=0)


def test_the_conversion_cache_key_follows_the_file_the_settings_and_the_switch(tmp_path, monkeypatch):
    from inferplane.worker.quant.startup_cache import ConversionCache

    monkeypatch.setenv("INFERPLANE_QUANT_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    a = ConversionCache.for_model(str(model), {"quantize_head": False})
    assert a.path == ConversionCache.for_model(str(model), {"quantize_head": False}).path
    assert a.path != ConversionCache.for_model(str(model), {"quantize_head": True}).path
    model.write_bytes(b"two!")  # new bytes (and size): a new digest
    assert a.path != ConversionCache.for_model(str(model), {"quantize_head": False}).path
    assert ConversionCache.for_model(str(tmp_path), {}) is None  # a folder (HF checkpoint) is not hashed
    # The gate figures stored with a conversion were measured on one kernel build: another build's
    # start finds another key and measures its own.
    from inferplane.worker.ops import native
    from inferplane.worker.quant.convert import cache_settings

    keys = set()
    for isa in native.supported_isas():
        monkeypatch.setattr(native, "kernels", lambda isa=isa: native.kernels_for(isa))
        keys.add(ConversionCache.for_model(str(model), cache_settings(True, 1.0, True, True)).path)
    assert len(keys) == len(native.supported_isas())
    a.save({"conversion": {"x": torch.ones(2)}})
    assert torch.equal(a.load()["conversion"]["x"], torch.ones(2))
    monkeypatch.setenv("INFERPLANE_QUANT_CACHE", "off")
    assert ConversionCache.for_model(str(model), {}) is None


def test_cpu_int8_llm_follows_float32_on_the_tiny_model(tiny_llama):
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM

    prompts = prompts_of_lengths([5, 12, 30], 320, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    dense = LLM(tiny_llama, runtime="paged", device="cpu", num_kv_blocks=64).generate(prompts, params)
    int8_llm = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64, kv_manager="paged",
                   skip_quality_gate=True)
    quant = int8_llm.generate(prompts, params)
    first = [d.token_ids[0] == q.token_ids[0] for d, q in zip(dense, quant, strict=True)]
    assert sum(first) >= 2  # random tiny weights have flat distributions; most first tokens still agree
    stats = int8_llm.stats()
    assert stats["gate_skipped"] == 1.0
    assert stats["weight_bytes_int8"] <= 0.3 * stats["weight_bytes_float32"]
    assert stats["model_bytes_int8"] < stats["model_bytes_float32"]


def test_gate_needs_a_tokenizer(tiny_llama):
    from inferplane.worker.llm import LLM

    with pytest.raises(ValueError, match="skip-quality-gate"):
        LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64)


def test_cpu_int8_refuses_other_devices_and_dtypes(tiny_llama):
    from inferplane.worker.engine.options import EngineOptions
    from inferplane.worker.engine.runtimes import prepare_weights

    options = EngineOptions(runtime="cpu-int8", skip_quality_gate=True)
    loaded = _tiny(tiny_llama)
    loaded.model.to("meta")  # stands for a GPU: anything that is not the CPU
    with pytest.raises(ValueError, match="runs on the CPU"):
        prepare_weights(options, loaded)
    loaded = _tiny(tiny_llama)
    loaded.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        prepare_weights(options, loaded)


@needs_native_int8
def test_a_model_on_the_c_kernels_generates_what_the_pytorch_one_does(tiny_llama, monkeypatch):
    """Every int8 layer packed and decode attention in C, against the same model on PyTorch's ops
    only (INFERPLANE_NATIVE=0 in effect): whole forward passes, prefill and decode, 1 to 3 rows."""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM

    prompts = prompts_of_lengths([5, 12, 30], 320, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True, quantize_head=True)
    packed = LLM(tiny_llama, **options)
    layers = [m for m in packed.engine.loaded.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.is_packed for m in layers)
    assert packed.stats()["int8_layers_packed"] == len(layers)
    on_c_kernels = [o.token_ids for o in packed.generate(prompts, params)]
    monkeypatch.setattr(native, "kernels", lambda: None)
    plain = LLM(tiny_llama, **options)
    assert not any(m.is_packed for m in plain.engine.loaded.model.modules() if isinstance(m, Int8Linear))
    assert on_c_kernels == [o.token_ids for o in plain.generate(prompts, params)]
