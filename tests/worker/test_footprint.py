"""Issue 53: a CPU worker knows its memory footprint (api/footprint.py, worker/serve/footprint.py).

The estimate is checked against real workers: `inferplane worker` on SmolLM2-135M (cpu-int8), started
as a pod's first start is (no start-up cache), its resident memory sampled until SERVING: the
estimate may not be below the measured peak or served figure, nor more than ESTIMATE_MARGIN above.
The limit's sources (cgroup v1, v2, the operator's variable) and the plan's three outcomes (fits;
the KV pool fitted; refused) are checked on their own, and a worker under a limit too small for
its model exits with the estimate instead of loading.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferplane.api.footprint import ESTIMATE_MARGIN, GiB, MiB, ModelSizes, estimate
from inferplane.api.model_config import ModelConfig
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.serve.footprint import LIMIT_ENV, MemoryTooSmall, memory_limit, plan

SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True)


def test_sizes_count_the_models_weights() -> None:
    sizes = ModelSizes.from_config(SMOLLM2)
    assert sizes.parameters == 134_515_008  # SmolLM2-135M's own count (HF's num_parameters)
    assert sizes.kv_bytes_per_token * 2 == 23_040  # float16 K and V of 30 layers x 3 heads x 64


def test_the_limit_is_the_smallest_of_cgroup_v1_v2_and_the_operators(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "memory" / "kubepods" / "pod1").mkdir(parents=True)
    (root / "kubepods.slice" / "pod2").mkdir(parents=True)
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("12:memory:/kubepods/pod1\n0::/kubepods.slice/pod2\n")
    assert memory_limit(root, proc, environ={}) is None  # nothing written: no limit
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (root / "memory.max").write_text("max\n")  # v2's
    assert memory_limit(root, proc, environ={}) is None
    (root / "memory" / "kubepods" / "pod1" / "memory.limit_in_bytes").write_text(str(3 * GiB))
    assert memory_limit(root, proc, environ={}) == 3 * GiB
    (root / "kubepods.slice" / "pod2" / "memory.max").write_text(str(2 * GiB))
    assert memory_limit(root, proc, environ={}) == 2 * GiB
    assert memory_limit(root, proc, environ={LIMIT_ENV: "1536Mi"}) == 1536 * MiB
    assert memory_limit(root, proc, environ={LIMIT_ENV: str(4 * GiB)}) == 2 * GiB


def options(**kw) -> EngineOptions:
    import torch

    return EngineOptions.from_kwargs(runtime="cpu-int8", device="cpu", **kw).settled(torch.device("cpu"))


def test_a_plan_fits_shrinks_the_kv_pool_or_refuses(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1024)
    args = dict(model_path=str(model), device_type="cpu", max_model_len=8192)
    whole = plan(SMOLLM2, options(), limit=None, **args)
    assert whole.kv_cache_memory is None and whole.footprint.kv_cache == GiB
    assert whole.footprint.needed_serving > whole.footprint.needed_at_start  # the 1 GiB pool decides
    assert plan(SMOLLM2, options(), limit=whole.footprint.needed, **args).kv_cache_memory is None

    tight = (whole.footprint.needed + whole.footprint.needed_at_start) // 2  # the pool gives what the limit lacks
    fitted = plan(SMOLLM2, options(), limit=tight, **args)
    assert fitted.kv_cache_memory == GiB - (whole.footprint.needed - tight)
    assert fitted.footprint.needed <= tight and "KV pool" in fitted.warning

    # The start-up peak comes before the pool exists: shrinking the pool cannot help it.
    start = whole.footprint.needed_at_start
    with pytest.raises(MemoryTooSmall, match=r"loading and converting the model needs"):
        plan(SMOLLM2, options(), limit=start - MiB, **args)
    assert plan(SMOLLM2, options(), limit=start, **args).kv_cache_memory is not None
    # ...nor can it go below one full-context sequence.
    with pytest.raises(MemoryTooSmall, match=r"one 524288-token sequence"):
        plan(SMOLLM2, options(max_num_seqs=1), limit=start, **{**args, "max_model_len": 8192 * 64})
    refused = plan(SMOLLM2, options(), limit=900 * MiB, strict=False, **args)  # INFERPLANE_MEMORY_CHECK=warn
    assert "Raise resources.memory" in refused.warning and refused.kv_cache_memory is None
    assert plan(SMOLLM2, options(), limit=900 * MiB, **{**args, "device_type": "cuda"}) is None


def test_the_estimate_grows_with_what_it_counts() -> None:
    sizes = ModelSizes.from_config(SMOLLM2)
    base = estimate(sizes, int8=True, kv_cache=GiB, max_num_seqs=16, max_num_batched_tokens=2048)
    dense = estimate(sizes, int8=False, kv_cache=GiB, max_num_seqs=16, max_num_batched_tokens=2048)
    assert dense.weights == 4 * sizes.parameters  # float32 weights
    assert base.weights == sizes.linear + 4 * (sizes.embedding + sizes.norms) + sizes.head  # int8 linears and head
    bigger_vocab = ModelSizes.from_config(dataclasses.replace(SMOLLM2, vocab_size=262144))
    assert estimate(bigger_vocab, int8=True, kv_cache=GiB, max_num_seqs=16,
                    max_num_batched_tokens=2048).peak > base.peak + 500 * MiB


def test_a_worker_under_too_small_a_limit_refuses_before_loading() -> None:
    from inferplane.api.model_resolution import builtin_model_path

    try:
        builtin_model_path("smollm2-135m")
    except Exception as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    done = subprocess.run([sys.executable, "-m", "inferplane.cli", "worker", "--model", "smollm2-135m",
                           "--runtime", "cpu-int8", "--device", "cpu", "--port", "0", "--metrics-port", "0"],
                          env={**__import__("os").environ, LIMIT_ENV: "900Mi"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    assert "the 900 MiB memory limit is too small for this model" in done.stderr, done.stderr[-2000:]
    assert "worker ready" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--kv-cache-memory", "64Mi"]])
def test_the_estimate_bounds_a_real_workers_memory(flags) -> None:
    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.bench.footprint import estimate_for, measure

    try:
        builtin_model_path("smollm2-135m")
    except Exception as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    flags = ["--runtime", "cpu-int8", *flags]
    estimated = estimate_for("smollm2-135m", flags)
    measured = measure("smollm2-135m", flags, cold=True, batch=estimated["batch"])
    print(measured, estimated)
    for what in ("peak", "served"):
        real, guess = measured[f"measured_{what}_mib"], estimated[f"estimate_{what}_mib"]
        assert real <= guess <= real * (1 + ESTIMATE_MARGIN), (what, real, guess, estimated["parts_mib"])
    # What the limit must hold: all but the reclaimable file pages.
    real, guess = measured["measured_anon_peak_mib"], estimated["estimate_needed_mib"]
    assert real <= guess <= real * (1 + ESTIMATE_MARGIN), ("needed", real, guess)


# --- the start-up gate's memory: logits a few rows at a time ------------------------------------------------


def whole_window_figures(ref: torch.Tensor, cand: torch.Tensor, ids: list[int]) -> tuple[float, ...]:
    """The gate's sums as they were computed before (every row's logits at once): the oracle."""
    import torch.nn.functional as F

    targets = torch.tensor(ids[1:])
    r, c = F.log_softmax(ref[:-1].double(), -1), F.log_softmax(cand[:-1].double(), -1)
    rows = torch.arange(len(targets))
    return (-float(r[rows, targets].sum()), -float(c[rows, targets].sum()),
            int((r.argmax(-1) == c.argmax(-1)).sum()), float((r.exp() * (r - c)).sum()))



@pytest.mark.parametrize("length", [2, 63, 64, 65, 200])
def test_the_gate_scores_rows_in_chunks_to_the_same_figures(length: int) -> None:
    from inferplane.worker.quant.gate import GATE_ROWS, GateAccumulator

    gen = torch.Generator().manual_seed(length)
    ref = torch.randn(length, 300, generator=gen) * 3
    cand = ref + torch.randn(length, 300, generator=gen)
    ids = torch.randint(0, 300, (length,), generator=gen).tolist()
    acc = GateAccumulator()
    acc.add(ref, cand, ids)
    expected = whole_window_figures(ref, cand, ids)
    got = (acc.nll_ref, acc.nll_cand, acc.agree, acc.kl)
    assert acc.count == length - 1 and got[2] == expected[2]
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))
    assert GATE_ROWS <= 64  # [rows, vocab] float32 at once: 64 MiB for a 262k vocabulary


def test_the_start_up_gate_keeps_hidden_states_not_logits(tiny_llama) -> None:
    """The float model's side is [T, hidden] per window, and its figures on a model against itself
    match those from whole windows' logits (what the gate computed before)."""
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.quant.gate import GateAccumulator, Reference, sequence_logits, windows

    loaded = load_model(tiny_llama, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, loaded.config.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    reference = Reference(loaded.model, ids, window=128)
    assert all(hidden.shape == (len(w), loaded.config.hidden_size) for w, hidden in reference.windows)
    scored = reference.score(loaded.model)
    whole = GateAccumulator()
    for window in windows(ids, 128):
        logits = sequence_logits(loaded.model, window)
        whole.add(logits, logits, window)
    expected = whole.result()
    assert scored.tokens == expected.tokens and scored.top1_agreement == 1.0
    assert abs(scored.ppl_float32 - expected.ppl_float32) <= 1e-4 * expected.ppl_float32
    assert abs(scored.kl_mean) < 1e-6


def test_the_kv_tiers_host_memory_counts_in_the_footprint() -> None:
    """A memory tier is full while serving, as the pool is; a disk tier alone holds its read-ahead."""
    from inferplane.worker.engine.kv.tiers.store import STAGED_BYTES

    sizes = ModelSizes(vocab_size=49152, hidden_size=576, widest=1536, embedding=28_311_552, head=28_311_552,
                       tied=True, linear=100_000_000, norms=35_136, file_bytes=100 << 20, kv_bytes_per_token=11_520)
    base = dict(int8=True, kv_cache=64 * MiB, max_num_seqs=16, max_num_batched_tokens=2048)
    plain, tiered = estimate(sizes, **base), estimate(sizes, **base, kv_offload=GiB)
    assert tiered.served - plain.served == GiB and tiered.needed_serving - plain.needed_serving == GiB
    assert "KV tiers" in tiered.describe() and "KV tiers" not in plain.describe()
    assert STAGED_BYTES <= 64 * MiB


def test_a_plan_gives_the_kv_tiers_memory_before_the_pool(tmp_path: Path) -> None:
    """Under a limit, the memory tier is taken first: the KV pool shrinks by what the tier holds."""
    from inferplane.worker.engine.kv.tiers.store import STAGED_BYTES

    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1024)
    args = dict(model_path=str(model), device_type="cpu", max_model_len=8192)
    limit = plan(SMOLLM2, options(), limit=None, **args).footprint.needed
    assert plan(SMOLLM2, options(), limit=limit, **args).kv_cache_memory is None
    tiered = plan(SMOLLM2, options(kv_offload_memory="256MiB"), limit=limit, **args)
    assert tiered.kv_cache_memory == GiB - 256 * MiB and tiered.footprint.kv_offload == 256 * MiB
    disk_only = plan(SMOLLM2, options(kv_offload_disk="8GiB", kv_offload_dir=str(tmp_path)), limit=limit, **args)
    assert disk_only.kv_cache_memory == GiB - STAGED_BYTES  # the disk's pages are the kernel's to reclaim
