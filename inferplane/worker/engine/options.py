"""Engine options: the knobs an InferenceDeployment's `engine` section and `LLM(...)` expose.

`inferplane worker`'s flags are these fields with their defaults. A default is not decided here: an
option the spec's `engine` section has takes the spec's default (api.deployment.EngineConfig), and
the ones a runtime preset decides stay None until `settled()` fills them by the same rule resolve()
applies to a deployment (api.resolve.engine_settings), so a runtime started by `LLM(...)`, by
`inferplane worker` or by a deployment runs with the same settings. Importing this module does not
import torch (the CLI builds its --help from it); resolving a device does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import pydantic

from inferplane.api.deployment import COMPUTE_DTYPES, SPECULATIVE_METHODS, EngineConfig, Speculative
from inferplane.api.quantities import kv_cache_fraction, parse_bytes
from inferplane.api.resolve import PRESETS, default_dtype, engine_settings

if TYPE_CHECKING:
    import torch

# The options a runtime's preset fills where they are left open (None).
PRESET_DECIDED = ("dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "kv_cache_dtype",
                  "decode_steps")


def parse_memory(value: int | float | str) -> int | float:
    """'2GiB' / '512Mi' / 1e9 → bytes (int); a number in (0, 1] → a fraction of free device memory.

    The grammar is the spec's (`api.quantities`), so a value the CRD admits is one the worker reads.
    """
    if isinstance(value, bool) or (isinstance(value, int | float) and value <= 0):
        raise ValueError(f"kv_cache_memory: must be positive, got {value!r}")
    if isinstance(value, int | float):
        return float(value) if value <= 1 else int(value)
    fraction = kv_cache_fraction(str(value).strip())
    if fraction is not None:
        return fraction
    try:
        amount = parse_bytes(value)
    except ValueError:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (examples: 2GiB, 512Mi, 0.9)") from None
    if amount <= 0:
        raise ValueError(f"kv_cache_memory: must be positive, got {value!r}")
    return amount


def option(default: Any, help: str, *, choices: Sequence[str] | None = None, hidden: bool = False) -> Any:
    """An engine option with what `inferplane worker` needs to offer it as a flag (see worker/serve/cli.py)."""
    return field(default=default, metadata={"help": help, "choices": choices, "hidden": hidden})


def spec_default(name: str) -> Any:
    """The default of the spec's engine field `name` (EngineConfig), which the option shares."""
    return EngineConfig.model_fields[name].default


@dataclass
class EngineOptions:
    """Every engine knob, each a `--kebab-case` flag of `inferplane worker` with the same default.

    The fields an InferenceDeployment's `engine` section sets carry the same names there
    (api.deployment.EngineConfig), so `api.resolve` turns a spec into these flags by name.
    """

    runtime: str = option("paged", "the runtime preset: KV manager and weight format (embedding: an encoder "
                                   "model's batched forward, no KV cache)", choices=tuple(PRESETS))
    device: str = option("auto", "where the engine runs", choices=("auto", "cpu", "cuda"))
    dtype: str | None = option(None, "compute dtype (default: bfloat16 on CUDA, float32 on CPU)",
                               choices=COMPUTE_DTYPES)
    block_size: int = option(spec_default("block_size"), "tokens per KV block")
    max_num_seqs: int | None = option(None, "sequences scheduled together (embedding: inputs per forward); "
                                            "default: the runtime's preset")
    max_num_batched_tokens: int | None = option(None, "tokens per engine step (prefill chunks included), at most "
                                                      "(embedding: padded tokens per forward); default: the "
                                                      "runtime's preset")
    step_target_ms: int = option(500, "size prefill chunks so a step takes about this long, measured "
                                      "(decodes wait no longer behind a long prompt); 0: always the maximum")
    kv_cache_memory: int | float | str | None = option(
        None, "KV pool size: bytes like 2GiB, or a fraction of free GPU memory like 0.9; default: the runtime's "
              "preset")
    kv_cache_dtype: str = option(spec_default("kv_cache_dtype"), "what the KV cache stores: auto is the runtime's "
                                 "choice (float16 on cpu-int8, else the compute dtype); float16 under float32 compute "
                                 "halves the KV memory and the bytes a decode step reads",
                                 choices=("auto", *COMPUTE_DTYPES))
    num_kv_blocks: int | None = option(None, "exact KV pool size; overrides kv_cache_memory (tests)", hidden=True)
    max_model_len: int | None = option(spec_default("max_model_len"), "longest sequence (default: the model's "
                                                                        "context)")
    kv_manager: str | None = option(None, "cpu-int8 only: the KV manager (default: the preset's, radix)",
                                    choices=("paged", "radix"))
    kv_offload_memory: str | None = option(
        spec_default("kv_offload_memory"), "radix KV managers: host memory (bytes like 2GiB) for KV blocks that "
                                           "leave the pool, read back instead of recomputed; unset: none")
    kv_offload_disk: str | None = option(
        spec_default("kv_offload_disk"), "radix KV managers: disk space (bytes like 20GiB) below the memory tier, "
                                         "in --kv-offload-dir; it outlives the worker")
    kv_offload_dir: str | None = option(None, "the disk tier's directory (a node-local volume in a cluster); "
                                              "blocks of other models or settings there are kept apart")
    kv_events: bool | None = option(
        spec_default("kv_events"), "radix KV managers: publish which KV blocks the worker holds, in the pool and "
                                   "each tier (vLLM's KV events, over the KVEvents stream), for the gateway's "
                                   "kv-aware routing; unset: on with the radix KV manager")
    skip_quality_gate: bool = option(False, "cpu-int8: serve even if the int8 quality gate fails")
    quantize_head: bool | None = option(
        spec_default("quantize_head"), "cpu-int8: the output head in int8 (unset: yes, the runtime's default; "
                                       "--no-quantize-head keeps it float32; embeddings stay float)")
    requantize_q4: bool = option(
        spec_default("requantize_q4"), "cpu-int8: requantize a GGUF file's 4-, 5-, 6- and 8-bit linears (Q4_0/Q4_1/"
                                       "Q4_K, Q5_0/Q5_1/Q5_K, Q6_K, Q8_0) to int8 (with smoothing) instead of serving "
                                       "their own blocks")
    max_loras: int = option(spec_default("max_loras"), "LoRA adapter slots (adapters served in one batch with the "
                                                        "base, loaded least recently used at request time); 0: none")
    max_lora_rank: int = option(spec_default("max_lora_rank"), "the largest LoRA rank an adapter slot holds")
    decode_steps: int | None = option(spec_default("decode_steps"), "cpu-int8: greedy decode steps per call while "
                                      "every running request decodes greedily and none waits (1: one step "
                                      "per round); default: the runtime's preset (8 on cpu-int8)")
    speculative: Speculative | dict | str | None = option(
        None, "speculative decoding, as the spec's engine.speculative (JSON for the flag): "
              "'{\"method\": \"ngram\", \"numTokens\": 5}'; ngram proposes from the request's own text, suffix "
              f"from it and the same tenant's recent requests (methods: {', '.join(SPECULATIVE_METHODS)}); unset: off")
    enforce_eager: bool = option(spec_default("enforce_eager"), "CUDA: run decode steps kernel by kernel instead of "
                                                                "replaying CUDA graphs")
    # Test hook: scales multiplied by this make a deliberately wrong quantization the gate must catch.
    quant_scale_multiplier: float = option(1.0, "cpu-int8 test hook: != 1 stores wrong scales", hidden=True)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            # cpu-int8 is the CPU runtime by definition, GPU or not.
            use_cuda = torch.cuda.is_available() and self.runtime != "cpu-int8"
            return torch.device("cuda" if use_cuda else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but no CUDA device is available")
        return device

    def settled(self, device: torch.device) -> EngineOptions:
        """These options with what they leave open filled from the runtime's preset for `device`
        (api.resolve.engine_settings: the rule a deployment's engine section is resolved by)."""
        filled = engine_settings(self.runtime, device.type, {name: getattr(self, name) for name in PRESET_DECIDED})
        return replace(self, **{name: filled[name] for name in PRESET_DECIDED})

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        name = self.dtype or default_dtype(device.type)
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(COMPUTE_DTYPES)}, got {name!r}")
        return getattr(torch, name)

    def resolve_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for an engine computing in `dtype`."""
        import torch

        if self.kv_cache_dtype == "auto":
            return dtype
        if self.kv_cache_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be auto or one of {', '.join(COMPUTE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        return getattr(torch, self.kv_cache_dtype)

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.step_target_ms < 0:
            raise ValueError("step_target_ms: must be 0 (off) or positive")
        if self.max_loras < 0:
            raise ValueError("max_loras: must be 0 (no adapters) or positive")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank: must be positive")
        if self.decode_steps is not None and not 1 <= self.decode_steps <= 64:
            raise ValueError("decode_steps: must be between 1 and 64")
        self.speculation()
        self.offload_sizes()

    def speculation(self) -> Speculative | None:
        """The speculative section (from a Speculative, a dict in the spec's or Python's field names,
        or its JSON text); a ValueError naming the field where it is not one."""
        value = self.speculative
        if value is None or isinstance(value, Speculative):
            return value
        try:
            if isinstance(value, str):
                return Speculative.model_validate_json(value)
            return Speculative.model_validate(value)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"speculative{'.' + where if where else ''}: {first['msg']}") from None

    def offload_sizes(self) -> tuple[int, int]:
        """(memory, disk) bytes of the KV tiers, 0 where a tier is off; ValueError naming the option."""
        sizes = []
        for name in ("kv_offload_memory", "kv_offload_disk"):
            value = getattr(self, name)
            try:
                size = parse_bytes(value) if value is not None else 0
            except ValueError:
                raise ValueError(f"{name}: cannot parse {value!r} (examples: 2GiB, 512Mi)") from None
            if value is not None and size <= 0:
                raise ValueError(f"{name}: must be positive, got {value!r}")
            sizes.append(size)
        if sizes[1] and not self.kv_offload_dir:
            raise ValueError("kv_offload_dir: the disk tier (kv_offload_disk) needs a directory")
        if self.kv_offload_dir and not sizes[1]:
            raise ValueError("kv_offload_disk: kv_offload_dir names a directory but no disk tier size")
        return sizes[0], sizes[1]
