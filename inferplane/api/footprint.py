"""How much memory a CPU worker takes: its footprint, estimated from the model's sizes and the engine
settings, before anything is loaded.

A worker is given `resources.memory` as its container's limit; one that needs more is OOM-killed
(issue 53: Gemma 3 270M on cpu-int8 held 3.3 GiB against a 2 GiB spec, and its first start peaked
at 7 GiB). So the worker estimates its footprint at start (worker/serve/footprint.py): it refuses to start
when the model cannot fit its limit, and fits its KV pool, the one part that can give, into what
the rest leaves. The estimate is a pure function of the model's config (vocabulary, widths, layers:
what `api.model_config.read_model_config` reads from a GGUF header or config.json) and the resolved
engine settings, so anything that has those can size a deployment with it.

The parts (bytes; measured on an x86 CPU worker with `python -m inferplane.bench.footprint`):
- runtime: the process beside the model: Python, PyTorch (674 MiB resident once imported, most of it
  its libraries' mapped pages), gRPC, the C kernels, the engine's own objects; measured as what a
  serving worker holds beyond its weights, KV pool and workspace: 836 MiB on SmolLM2-135M, 928 MiB
  on Gemma 3 270M (the difference scales with the vocabulary: VOCAB_OVERHEAD_BYTES).
- weights, as served: cpu-int8 keeps linear layers at one byte per weight or less (int8, or a GGUF
  file's own 4-8-bit blocks) plus a float32 scale per row, the input embeddings in float32 and the
  output head in int8 (a copy of a tied embedding); dense runtimes keep every weight in float32.
  The GGUF file stays mapped.
- kv_cache: the pool the engine allocates, zeroed, once the weights are ready: `kv_cache_memory`, at
  most every sequence slot at full context (max_num_seqs x max_model_len tokens).
- workspace: one step's activations and logits (max_num_batched_tokens rows through the widest
  layer, max_num_seqs rows of logits) and the tokenizer's and engine's vocabulary-wide tables.
- startup: what loading and the cpu-int8 conversion hold at their peak beyond the runtime: the
  float32 model (every weight dequantized from the file), the mapped file, the int8 weights being
  made, and the conversion's temporaries, the largest of which come from the head: the start-up
  measurement of the int8 kernels dequantizes the widest weight to float32 and multiplies it. It
  ends before the KV pool is allocated, so the two never add up. A start that restores the
  conversion from its cache (quant/startup_cache.py) peaks about as high: the loading dominates.
- mapped: the pages of files (PyTorch's libraries, the GGUF file) among the above. They count as
  resident, but a cgroup at its limit reclaims them before it kills anything, so what must fit the
  limit (`needed`) counts only MAPPED_HOT_BYTES of them, the code a running worker keeps touching.

Resident (what `kubectl top` and the issue saw) is `peak`; what the limit must hold is `needed`.
Measured against the estimate (first starts, the KV pool at 64 MiB and at 1 GiB, then a batch of
the engine's largest shape served): on cpu-int8 the resident estimate is 6-14% above the measured
peak and served figures for SmolLM2-135M and Gemma 3 270M (served with a 64 MiB pool: 17% on Gemma,
up to 27% on SmolLM2, whose process is smaller than RUNTIME_BYTES assumes), and `needed` 13-19%
above the measured anonymous peak; on the dense paged runtime (SmolLM2, float32, 600 MiB pool) 19% and 35% above (its
workspace term, 256 rows of logits and 8,192 tokens of activations, is generous).
tests/worker/test_footprint.py checks SmolLM2 on cpu-int8 within ESTIMATE_MARGIN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inferplane.api.model_config import ModelConfig

MiB = 1 << 20
GiB = 1 << 30
RUNTIME_BYTES = 1000 * MiB
# Of it, the pages of PyTorch's and the other libraries' files (measured: 500 MiB), and how much of
# the mapped pages a running worker keeps touching (its hot code; a guess kept generous).
RUNTIME_MAPPED_BYTES = 500 * MiB
MAPPED_HOT_BYTES = 128 * MiB
# Per vocabulary entry, what the tokenizer, the sampler's per-token tables and the engine's other
# vocabulary-wide buffers take beyond the weights (fitted on SmolLM2 and Gemma 3).
VOCAB_OVERHEAD_BYTES = 1500
# Temporaries the conversion holds at its peak, in float32 copies of the widest weight (the head),
# and beyond them (the kernels' start-up measurements, the gate's windows, allocator slack).
CONVERSION_HEAD_COPIES = 2.0
CONVERSION_EXTRA_BYTES = 200 * MiB
# How far above the measured figures the estimate may be (checked by the tests). Where the KV pool
# is small the fixed parts dominate, and RUNTIME_BYTES is sized for the widest vocabulary's process:
# SmolLM2 with a 64 MiB pool was measured 24.7-27% above on an AVX-512 EPYC (2026-12-06, Gemma 3
# 270M 17%) and below 25% on other machines, so 25% failed by chance there.
ESTIMATE_MARGIN = 0.30


@dataclass(frozen=True)
class ModelSizes:
    """The numbers of weights of each kind, from a model's config (no weights read)."""

    vocab_size: int
    hidden_size: int
    widest: int  # the widest activation a step computes (the MLP's inner width, or the model's)
    embedding: int  # input embedding weights (vocab x hidden)
    head: int  # output head weights; a tied head shares the embedding's (counted here once more: cpu-int8 copies it)
    tied: bool
    linear: int  # every other matrix: attention, MLP, experts, routers
    norms: int  # the norms' weights (float32 in every runtime)
    file_bytes: int  # the weights' files on disk (a GGUF file is mapped while serving)
    kv_bytes_per_token: int  # per element byte of the KV dtype: 2 x KV heads x head dim x layers

    @classmethod
    def from_config(cls, config: ModelConfig, file_bytes: int = 0) -> ModelSizes:
        hidden, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        attention = hidden * q + 2 * hidden * kv + q * hidden
        linear = 0
        for layer in range(config.num_layers):
            if config.is_moe_layer(layer):
                mlp = config.num_experts * (3 * hidden * config.moe_intermediate_size + hidden)
            else:
                mlp = 3 * hidden * config.intermediate_size
            linear += attention + mlp
        norms_per_layer = 2 + 2 * config.sandwich_norms
        norms = (hidden * (norms_per_layer * config.num_layers + 1)
                 + 2 * config.head_dim * config.qk_norm * config.num_layers)
        widest = max(config.intermediate_size, config.moe_intermediate_size * max(config.experts_per_token, 1),
                     hidden, q + 2 * kv)
        vocab = config.vocab_size * hidden
        return cls(vocab_size=config.vocab_size, hidden_size=hidden, widest=widest, embedding=vocab, head=vocab,
                   tied=config.tie_word_embeddings, linear=linear, norms=norms, file_bytes=file_bytes,
                   kv_bytes_per_token=2 * kv * config.num_layers)

    @property
    def parameters(self) -> int:
        return self.embedding + self.linear + self.norms + (0 if self.tied else self.head)


@dataclass(frozen=True)
class Footprint:
    """A worker's memory, by part (bytes); see the module's docstring for what each holds."""

    runtime: int
    weights: int
    kv_cache: int
    workspace: int
    startup: int  # held at the start-up peak beyond `runtime` (before the KV pool exists)
    mapped: int  # file pages among the above (libraries, the model file)
    kv_offload: int = 0  # the KV tiers' host memory (memory tier, disk read-ahead), full while serving

    @property
    def served(self) -> int:
        """Resident while serving (the pool is zeroed when allocated, so it is resident at once)."""
        return self.runtime + self.weights + self.kv_cache + self.workspace + self.kv_offload

    @property
    def peak(self) -> int:
        """Resident at its highest: the start-up peak or serving."""
        return max(self.runtime + self.startup, self.served)

    @property
    def needed_at_start(self) -> int:
        return self.runtime + self.startup - self.mapped + MAPPED_HOT_BYTES

    @property
    def needed_serving(self) -> int:
        return self.served - self.mapped + MAPPED_HOT_BYTES

    @property
    def needed(self) -> int:
        """The memory limit the worker needs: its file pages may be reclaimed, all else must fit."""
        return max(self.needed_at_start, self.needed_serving)

    def describe(self) -> str:
        parts = (("runtime", self.runtime), ("weights", self.weights), ("KV pool", self.kv_cache),
                 ("workspace", self.workspace), *((("KV tiers", self.kv_offload),) if self.kv_offload else ()))
        served = " + ".join(f"{name} {mib(value)}" for name, value in parts)
        return (f"needs {mib(self.needed)} (start-up {mib(self.needed_at_start)}, serving "
                f"{mib(self.needed_serving)}; resident with the {mib(self.mapped)} of mapped files: serving "
                f"{served} = {mib(self.served)}, start-up {mib(self.runtime + self.startup)})")


def mib(value: int) -> str:
    return f"{value / MiB:.0f} MiB"


def kv_pool_bytes(sizes: ModelSizes, *, kv_cache_memory: int, kv_dtype_bytes: int, max_model_len: int,
                  max_num_seqs: int, block_size: int) -> int:
    """The KV pool the engine allocates: `kv_cache_memory`, at most every sequence slot at full
    context (the engine's cap; sliding-window layers, which hold less, are counted whole here)."""
    blocks = math.ceil(max_model_len / block_size) * max_num_seqs
    return min(kv_cache_memory, blocks * block_size * sizes.kv_bytes_per_token * kv_dtype_bytes)


def one_sequence_kv_bytes(sizes: ModelSizes, *, kv_dtype_bytes: int, max_model_len: int, block_size: int) -> int:
    """The KV of one sequence at full context: the smallest pool that serves every request."""
    return math.ceil(max_model_len / block_size) * block_size * sizes.kv_bytes_per_token * kv_dtype_bytes


def estimate(sizes: ModelSizes, *, int8: bool, kv_cache: int, max_num_seqs: int, max_num_batched_tokens: int,
             quantize_head: bool = True, kv_offload: int = 0) -> Footprint:
    """The footprint of a CPU worker serving a model of `sizes`: cpu-int8 (`int8`) or a dense
    runtime in float32, with a KV pool of `kv_cache` bytes (kv_pool_bytes) and `kv_offload` bytes
    of KV tiers in host memory."""
    vocab_bytes = sizes.vocab_size * VOCAB_OVERHEAD_BYTES
    workspace = (max_num_batched_tokens * (4 * sizes.hidden_size + 2 * sizes.widest) * 4
                 + max_num_seqs * sizes.vocab_size * 4 * 2 + vocab_bytes)
    float_model = 4 * sizes.parameters
    if int8:
        head = sizes.head * (1 if quantize_head else (0 if sizes.tied else 4))
        weights = sizes.linear + 4 * (sizes.embedding + sizes.norms) + head + sizes.file_bytes
        startup = (float_model + sizes.file_bytes + head + sizes.linear
                   + int(CONVERSION_HEAD_COPIES * 4 * sizes.head) + vocab_bytes + CONVERSION_EXTRA_BYTES)
    else:
        weights = float_model + sizes.file_bytes
        startup = (float_model + sizes.file_bytes + 4 * max(sizes.head, sizes.embedding) + vocab_bytes
                   + CONVERSION_EXTRA_BYTES)
    return Footprint(runtime=RUNTIME_BYTES, weights=weights, kv_cache=kv_cache, workspace=workspace, startup=startup,
                     mapped=RUNTIME_MAPPED_BYTES + sizes.file_bytes, kv_offload=kv_offload)
