"""The C kernels (worker/native): built here, and each equal to the PyTorch path it replaces, on
every ISA build this CPU can run (so an AVX-512 machine tests the AVX2 code too)."""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess

import pytest
import torch

from inferplane.worker.ops import native
from inferplane.worker.ops.attention import AttentionBatch, paged_attention
from inferplane.worker.quant.int8_linear import Int8Linear

KERNELS = native.kernels()
HAS_TOOLCHAIN = platform.machine() == "x86_64" and shutil.which("cc") is not None
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler or not x86-64 here")
# Every build this CPU runs, and the test builds that stand in for one it cannot (EMULATED_BUILDS:
# AVX-VNNI's tiles on an AVX2 or AVX-512 CPU without it); none (so the tests below are not collected)
# only without a toolchain.
ISAS = native.supported_isas() + native.emulated_isas() if HAS_TOOLCHAIN else []


@pytest.fixture(params=ISAS)
def isa_kernels(request, monkeypatch) -> native.NativeKernels:
    """One ISA's build, also installed as `native.kernels()` so model code calls it."""
    loaded = native.kernels_for(request.param)
    assert loaded is not None and loaded.isa == request.param
    monkeypatch.setattr(native, "kernels", lambda: loaded)
    return loaded


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None, reason="no x86-64 C toolchain")
def test_the_kernels_build_wherever_a_compiler_is():
    """Without this, a broken build would only show as every other test here being skipped. Every
    x86-64 CPU this project runs on has at least AVX2 + FMA, and every build gets the int8 kernel."""
    assert KERNELS is not None
    assert KERNELS.path.exists()
    assert "avx2" in ISAS, f"this CPU runs none of the AVX2 builds: {sorted(native.cpu_flags())}"
    assert KERNELS.isa == ISAS[0]
    for isa in ISAS:
        built = native.kernels_for(isa)
        assert built is not None and built.isa == isa and built.has_int8_linear and built.has_f32_linear


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no x86-64 C toolchain")
def test_the_isa_can_be_forced_and_an_unavailable_one_is_refused(monkeypatch, caplog):
    """INFERPLANE_NATIVE_ISA=avx2 runs the AVX2 code on an AVX-512 machine; a name the CPU cannot
    run falls back to the best build, with a warning naming it."""
    native.kernels.cache_clear()
    try:
        monkeypatch.setenv("INFERPLANE_NATIVE_ISA", "avx2")
        assert native.kernels().isa == "avx2"
        assert set(native.kernel_isas(native.kernels()).values()) == {"avx2"}
        native.kernels.cache_clear()
        monkeypatch.setenv("INFERPLANE_NATIVE_ISA", "sse2")
        with caplog.at_level(logging.WARNING, logger="inferplane.worker.ops.native"):
            assert native.kernels().isa == ISAS[0]
        assert "INFERPLANE_NATIVE_ISA=sse2" in caplog.text
        assert native.supported_isas(frozenset({"avx", "avx2", "fma"})) == []  # no BMI2/F16C: no build
    finally:
        native.kernels.cache_clear()


def test_the_emulated_avx_vnni_build_stands_in_only_where_the_real_one_cannot_run(monkeypatch, caplog):
    """The AVX-VNNI tiles run in these tests on every AVX2 CPU: emulated where the CPU lacks AVX-VNNI,
    the real build where it has it. A worker never chooses the emulated build."""
    v3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
    assert native.emulated_isas(v3) == ["avx2-vnni-emulated"]
    assert native.emulated_isas(v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}) == [
        "avx2-vnni-emulated"]
    assert native.emulated_isas(v3 | {"avx_vnni"}) == []  # the real avx2-vnni build is among the ISAs
    assert native.emulated_isas(frozenset({"sse2"})) == []
    if not HAS_TOOLCHAIN:
        return
    native.kernels.cache_clear()
    try:
        monkeypatch.setenv("INFERPLANE_NATIVE_ISA", "avx2-vnni-emulated")
        with caplog.at_level(logging.WARNING, logger="inferplane.worker.ops.native"):
            assert native.kernels().isa == ISAS[0] != "avx2-vnni-emulated"
        assert "INFERPLANE_NATIVE_ISA=avx2-vnni-emulated" in caplog.text
    finally:
        native.kernels.cache_clear()


@pytest.mark.skipif(not HAS_TOOLCHAIN or shutil.which("objdump") is None, reason="no x86-64 C toolchain")
def test_the_real_avx_vnni_build_compiles_to_the_instruction_the_emulation_stands_for(tmp_path):
    """The emulated build runs the AVX-VNNI code; this checks the real build of that code compiles
    on any machine and uses the VEX vpdpbusd (the emulation's stand-in is only in the test build)."""
    from inferplane.worker.ops.native import build

    real, emulated = tmp_path / "real.so", tmp_path / "emulated.so"
    try:
        build._build(build._compiler(), "avx2-vnni", real)
    except RuntimeError as exc:  # GCC before 11 has no -mavxvnni: no machine of it could build the real one
        pytest.skip(f"this compiler cannot build AVX-VNNI code: {str(exc)[-200:]}")
    build._build(build._compiler(), "avx2-vnni-emulated", emulated)
    code = {path: subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
            for path in (real, emulated)}
    assert "vpdpbusd" in code[real]  # the VEX form: -march=x86-64-v3 has no AVX-512 to encode it otherwise
    assert "vpdpbusd" not in code[emulated]


def test_pack_and_unpack_are_inverse():
    q = torch.randint(-127, 128, (48, 20), dtype=torch.int8)
    packed = native.pack_int8_weight(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16, 4)
    assert int(packed[1, 2, 7, 3]) == int(q[16 + 7, 2 * 4 + 3]) + 128  # block, input group, channel, input
    assert torch.equal(native.unpack_int8_weight(packed), q)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 15, 16, 17, 33])
@pytest.mark.parametrize("out_features", [48, 128])  # 3 blocks of 16 (one at a time) and 8 (four at a time)
def test_int8_linear_equals_the_dynamic_kernel(isa_kernels, rows, out_features):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(76, out_features, bias=True)  # 76 inputs: vector loops and scalar tails
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 76) * torch.linspace(0.1, 4, 76)
    expected = layer.forward_dynamic(x)
    packed = native.pack_int8_weight(layer.qweight)
    got = isa_kernels.int8_linear(x, packed, layer.scale, layer.bias)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_int8_linear_is_exact_at_the_extremes_of_int8(isa_kernels):
    """Weights of -128 and 127 against inputs of +-127: the AVX2 path's int16 pair sums are at their
    largest here (2 * 128 * 127), and must neither saturate nor lose a sign."""
    n, k = 32, 64
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[::2] = -128
    q[:, ::3] = -127
    x = torch.where(torch.arange(k) % 2 == 0, 5.0, -5.0).repeat(3, 1)  # quantizes to +-127
    x[1] = -x[1]
    scale = torch.ones(n)
    got = isa_kernels.int8_linear(x, native.pack_int8_weight(q), scale, None)
    expected = (torch.round(x / (5.0 / 127)).to(torch.int64) @ q.to(torch.int64).t()).float() * (5.0 / 127)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-3)


def test_int8_linear_reads_strided_rows_and_zero_rows(isa_kernels):
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 32, bias=False))
    wide = torch.randn(6, 100)
    x = wide[:, 10:74]  # rows 100 floats apart
    x[2] = 0.0  # an all-zero row must not divide by zero
    packed = native.pack_int8_weight(layer.qweight)
    got = isa_kernels.int8_linear(x, packed, layer.scale, None)
    torch.testing.assert_close(got, layer.forward_dynamic(x.contiguous()), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], torch.zeros(32))


def _decode_case(lengths: list[int], heads: int, kv_heads: int, dim: int = 32, block_size: int = 4,
                 kv_dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(sum(lengths))
    blocks_needed = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(blocks_needed) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=gen)  # blocks scattered over the pool, as in use
    width = max(blocks_needed)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = order[used:used + n]
        used += n
    # q as the model has it: a view of the fused q|k|v rows, not contiguous
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, dim, generator=gen)
    batch = AttentionBatch(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lengths),
                           decode_block_tables=tables, decode_context_lens=torch.tensor(lengths),
                           decode_max_len=max(lengths))
    return qkv[:, :heads], k_cache, v_cache, batch


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("dim", [12, 24, 32, 72])  # no vectors, 3 of 8, one group of 4, 4 + 4 + 1
@pytest.mark.parametrize("lengths", [[1, 4, 5, 13, 40], [19]])  # a task per sequence; per query head
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_paged_decode_attention_equals_gather_and_sdpa(isa_kernels, heads, kv_heads, dim, lengths, kv_dtype,
                                                       monkeypatch):
    q, k_cache, v_cache, batch = _decode_case(lengths, heads, kv_heads, dim, kv_dtype=kv_dtype)
    assert isa_kernels.decode_attention_applies(q, k_cache, batch.decode_block_tables, batch.decode_context_lens)
    kv = q[:, :kv_heads]  # this step's k, v: only prefills read them
    scale = dim**-0.5
    got = paged_attention(q, kv, kv, k_cache, v_cache, batch, scale)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = paged_attention(q, kv, kv, k_cache, v_cache, batch, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 600])
def test_decode_attention_of_a_row_is_the_same_bits_whatever_its_batch(isa_kernels, kv_dtype, window, monkeypatch):
    """Contexts long enough to be split in parts (and merged) give each row the same bits alone as
    in any batch: a seeded request's draws, and speculative verification rows, depend on it. The
    batch's result is still the gather and SDPA's."""
    lengths = [1, 300, 700, 2100, 40, 1024]
    q, k_cache, v_cache, batch = _decode_case(lengths, 9, 3, dim=64, kv_dtype=kv_dtype)
    tables, lens = batch.decode_block_tables, batch.decode_context_lens
    together = isa_kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, 0.125, window)
    for i in range(len(lengths)):
        for rows in ([i], [i, 0], [3, i], list(range(i + 1))):
            alone = isa_kernels.paged_decode_attention(q[rows].contiguous(), k_cache, v_cache,
                                                       tables[rows].contiguous(), lens[rows].contiguous(), 0.125,
                                                       window)
            assert torch.equal(alone[rows.index(i)], together[i]), (i, rows)
    kv = q[:, :3]
    got = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.125, window=window)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.125, window=window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_windowed_decode_attention_equals_the_masked_gather(isa_kernels, window, kv_dtype, monkeypatch):
    """A sliding layer's decode on the C kernel reads each context's last `window` tokens: the same
    as the masked gather and SDPA, for contexts shorter and longer than the window."""
    q, k_cache, v_cache, batch = _decode_case([1, 4, 5, 13, 40], 6, 2, dim=24, kv_dtype=kv_dtype)
    kv = q[:, :2]
    got = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.2, window=window)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.2, window=window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    whole = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.2)
    assert not torch.allclose(got[-1], whole[-1])  # the window bound what the 40-token context read


@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_decode_attention_equals_the_explicit_softmax(isa_kernels, window, monkeypatch):  # noqa: F811
    """Gemma 2's scores, cap * tanh(score / cap), on the C kernel: the same as PyTorch's explicit
    softmax, with scores large enough that the cap changes the answer."""
    q, k_cache, v_cache, batch = _decode_case([1, 4, 5, 13, 40], 6, 2, dim=24)
    q, kv = q * 3, q[:, :2]
    got = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.5, window=window, softcap=2.0)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.5, window=window, softcap=2.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    uncapped = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.5, window=window)
    assert not torch.allclose(got, uncapped, atol=1e-3)


@pytest.mark.parametrize(("lengths", "window"), [([600], None), ([600], 300), ([200, 1, 2], None), ([900, 70], 500)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("dim", [12, 40])  # no vectors; five
def test_decode_attention_split_into_parts_of_a_context_equals_one_softmax(isa_kernels, lengths, window, kv_dtype,
                                                                            softcap, dim, monkeypatch):
    """Fewer sequences than two a thread, with contexts long enough: each context is attended in
    parts on different threads and the parts merged (csrc/attention.c merge_parts). The merged answer is
    the one softmax over the whole (windowed, soft-capped) context, including a sequence too short
    to give every part a token (an empty part) beside a long one, and scores far apart."""
    q, k_cache, v_cache, batch = _decode_case(lengths, 6, 2, dim=dim, block_size=16, kv_dtype=kv_dtype)
    q, kv = q * 4, q[:, :2]
    got = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.5, window=window, softcap=softcap)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = paged_attention(q, kv, kv, k_cache, v_cache, batch, 0.5, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_paged_decode_attention_handles_long_contexts_and_extreme_scores(isa_kernels, monkeypatch):
    """A softmax over 700 tokens with scores hundreds apart: the kernel's exp must neither overflow
    nor lose the few keys that matter."""
    q, k_cache, v_cache, batch = _decode_case([700, 3], 4, 2, dim=16, block_size=16)
    q = q * 30
    kv = q[:, :2]
    got = paged_attention(q, kv, kv, k_cache, v_cache, batch, 1.0)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = paged_attention(q, kv, kv, k_cache, v_cache, batch, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_the_kernels_are_off_and_say_so(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("INFERPLANE_NATIVE_DIR", str(tmp_path))
    native.kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="inferplane.worker.ops.native"):
            assert native.kernels() is None
        assert "native kernels unavailable" in caplog.text
        monkeypatch.setenv("INFERPLANE_NATIVE", "0")
        native.kernels.cache_clear()
        assert native.kernels() is None
    finally:
        native.kernels.cache_clear()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None, reason="no x86-64 C toolchain")
def test_a_failed_build_is_reported_with_the_compiler_message(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "kernels.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native.build, "SOURCE", broken)
    monkeypatch.setenv("INFERPLANE_NATIVE_DIR", str(tmp_path / "cache"))
    native.kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="inferplane.worker.ops.native"):
            assert native.kernels() is None
        assert "error" in caplog.text
        assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is left to load later
    finally:
        native.kernels.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_rms_norm_and_the_residual_add_before_it(isa_kernels, rows):
    from inferplane.worker.ops.norm import RMSNorm

    torch.manual_seed(rows)
    norm = RMSNorm(40, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    x, delta = torch.randn(rows, 40) * 3, torch.randn(rows, 40)
    expected_sum = x + delta
    expected = norm.weight * (expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(isa_kernels.rms_norm(x.clone(), norm.weight.detach(), 1e-5), norm.weight.detach() * (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)), rtol=1e-5, atol=1e-6)
    summed, normed = norm.add_and_norm(x, delta)
    torch.testing.assert_close(summed, expected_sum)
    torch.testing.assert_close(normed, expected.detach(), rtol=1e-5, atol=1e-6)


def test_silu_mul_matches_pytorch_including_saturated_gates(isa_kernels):
    gate = torch.cat([torch.randn(3, 20) * 4, torch.tensor([[-120.0, 120.0, -88.0, 95.0] * 5])])
    up = torch.randn(4, 20)
    got = isa_kernels.silu_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()


def test_gelu_mul_matches_pytorchs_tanh_gelu_including_saturated_gates(isa_kernels):
    gate = torch.cat([torch.randn(3, 21) * 4, torch.tensor([[-120.0, 120.0, -30.0, 45.0, 0.0, -1e-3, 9.5] * 3])])
    up = torch.randn(4, 21)
    got = isa_kernels.gelu_mul(torch.cat([gate, up], dim=1))
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("vocab", [1, 7, 16, 49152, 49157])  # tails shorter than a vector, and none
def test_argmax_rows_is_torchs_argmax_with_ties_infinities_and_nans(isa_kernels, vocab):
    torch.manual_seed(vocab)
    rows = torch.randn(9, vocab)
    rows[1] = float("-inf")  # a row the grammar masked whole: index 0, as torch says
    rows[2, : vocab // 2] = 3.0  # ties: the first wins
    rows[3, -1] = float("inf")
    rows[4, vocab // 3] = float("nan")  # NaN counts as largest, the first one wins
    rows[4, -1] = float("nan")
    rows[5, -1] = 50.0  # the maximum in the tail or the last vector
    rows[6] = -rows[6].abs() - 1  # all negative
    for x in (rows, torch.cat([rows, rows], dim=1)[:, :vocab]):  # contiguous, and rows further apart
        assert torch.equal(isa_kernels.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize(("experts", "top_k", "normalize"), [(4, 2, True), (8, 2, True), (128, 8, False), (3, 3, True)])
def test_moe_route_is_softmax_and_topk_renormalised(isa_kernels, experts, top_k, normalize):
    """The router's choice (model/moe.py on the CPU, and the fused decode): the experts topk picks,
    most probable first, and their softmax probabilities, renormalised where asked, within float
    rounding of PyTorch's; an equal pair goes to the lower id."""
    torch.manual_seed(experts)
    logits = torch.randn(7, experts) * 4
    logits[0] = 0.5  # all equal: the first k ids
    logits[1, -1] = 80.0  # one expert takes (nearly) all the probability
    weights, ids = isa_kernels.moe_route(logits, top_k, normalize)
    probs = torch.softmax(logits, dim=-1)
    expected_weights, expected_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    assert torch.equal(ids[1:], expected_ids[1:])
    assert ids[0].tolist() == list(range(top_k))
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="ip_moe_route"):  # more experts a token than there are
        isa_kernels.moe_route(logits, experts + 1, normalize)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])  # float16: stored rounded to nearest even
def test_rope_and_kv_store_in_one_pass_match_the_pytorch_ops(isa_kernels, kv_dtype):
    from inferplane.worker.ops.rope import rope, store_kv

    heads, kv_heads, dim, t = 4, 2, 16, 5
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, heads + 2 * kv_heads, dim, generator=gen)
    angles = torch.rand(t, 1, dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], -1)
    slots = torch.tensor([9, 2, 14, 0, 5])
    caches = [torch.zeros(4, 4, kv_heads, dim, dtype=kv_dtype) for _ in range(4)]  # ours k, v; reference k, v

    qk = rope(qkv[:, : heads + kv_heads], cos, signed_sin)
    store_kv(caches[2], caches[3], qk[:, heads:], qkv[:, heads + kv_heads:], slots)
    fused = qkv.clone()
    isa_kernels.rope_store_kv(fused, heads, kv_heads, cos, signed_sin, slots, caches[0], caches[1])
    torch.testing.assert_close(fused[:, : heads + kv_heads], qk, rtol=1e-6, atol=1e-6)
    close = dict(rtol=1e-6, atol=1e-6) if kv_dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)  # an ulp
    torch.testing.assert_close(caches[0], caches[2], **close)
    assert torch.equal(caches[1], caches[3]) and caches[1].abs().sum() > 0


def test_a_cpu_engine_says_which_isa_each_kernel_runs_on(tiny_llama, isa_kernels, monkeypatch):
    from prometheus_client import generate_latest

    from inferplane.worker.llm import LLM
    from inferplane.worker.serve.metrics import WorkerMetrics

    stats = LLM(tiny_llama, device="cpu", num_kv_blocks=16).stats()
    on_kernels = {key.split(":")[1]: key.split(":")[2] for key in stats if key.startswith("native_kernel:")}
    assert on_kernels["decode_attention"] == on_kernels["rms_norm"] == isa_kernels.isa
    assert on_kernels["int8_linear"] == "torch"  # a dense runtime has no int8 layers
    assert stats["native_kernels"] == sum(isa != "torch" for isa in on_kernels.values()) >= 4
    exposition = generate_latest(WorkerMetrics("tiny", "paged", lambda: stats).registry).decode()
    assert f'inferplane_worker_native_kernel{{isa="{isa_kernels.isa}",kernel="decode_attention",' in exposition

    int8 = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=16, skip_quality_gate=True).stats()
    assert int8[f"native_kernel:int8_linear:{isa_kernels.isa}"] == 1.0

    monkeypatch.setattr(native, "kernels", lambda: None)
    stats = LLM(tiny_llama, device="cpu", num_kv_blocks=16).stats()
    assert stats["native_kernels"] == 0.0 and stats["native_kernel:decode_attention:torch"] == 1.0


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9, 17])
def test_f32_linear_equals_pytorch_with_a_ragged_inner_dimension(isa_kernels, rows):
    """76 inputs: whole vectors then a masked tail on both ISAs (16 + 12 lanes, 8 + 4 lanes)."""
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 76), torch.randn(40, 76), torch.randn(40)
    torch.testing.assert_close(isa_kernels.f32_linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(isa_kernels.f32_linear(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_int8_dequantize_inverts_the_packing_and_applies_the_scales(isa_kernels):
    q = torch.randint(-128, 128, (48, 20), dtype=torch.int8)
    scale = torch.rand(48) + 0.5
    got = isa_kernels.int8_dequantize(native.pack_int8_weight(q), scale)
    assert torch.equal(got, q.float() * scale[:, None])


def test_every_isa_generates_what_pytorch_generates(tiny_llama, isa_kernels, monkeypatch):
    """Whole cpu-int8 forwards (prefill and decode, 1 to 3 rows) on this ISA's kernels give the
    tokens PyTorch's ops give: the int8 products are exact on every build. (A float32 KV cache: a
    float16 one rounds the last-bit differences of the two paths' float sums to whole float16 steps,
    enough to flip a near tie of this random model; test_fused_decode covers the float16 cache.)"""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM
    from tests.worker.conftest import prompts_of_lengths

    prompts = prompts_of_lengths([5, 12, 30], 320, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True, quantize_head=True,
                   kv_cache_dtype="float32")
    on_kernels = LLM(tiny_llama, **options)
    assert on_kernels.stats()[f"native_kernel:int8_linear:{isa_kernels.isa}"] == 1.0
    tokens = [o.token_ids for o in on_kernels.generate(prompts, params)]
    monkeypatch.setattr(native, "kernels", lambda: None)
    assert tokens == [o.token_ids for o in LLM(tiny_llama, **options).generate(prompts, params)]


def test_the_fused_decoder_layer_gives_the_op_by_op_results(tiny_llama, isa_kernels, monkeypatch):
    """ip_decode_layers runs the same kernels in the same order as the layer's Python: the same tokens
    and the same logprobs, for decode batches of sequences with different context lengths."""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM
    from inferplane.worker.ops import fused_decode
    from tests.worker.conftest import prompts_of_lengths

    prompts = prompts_of_lengths([3, 17, 40, 9], 320, seed=5)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    # paged: a radix cache would serve the second run's prompts from the first run's KV
    llm = LLM(tiny_llama, runtime="cpu-int8", device="cpu", num_kv_blocks=64, skip_quality_gate=True,
              kv_manager="paged")
    calls = []
    real = isa_kernels.decode_layers
    monkeypatch.setattr(isa_kernels, "decode_layers", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    fused = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert calls and max(calls) == len(prompts)  # decode steps of the whole batch took the fused path
    monkeypatch.setattr(fused_decode.FusedDecode, "forward", lambda *a, **k: None)
    assert fused == [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
