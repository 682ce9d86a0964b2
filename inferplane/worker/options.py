"""Engine options: the knobs an InferenceDeployment's `engine` section and `LLM(...)` expose.

The one home of the engine's defaults: `inferplane worker`'s flags take theirs from here. Importing
this module does not import torch (the CLI builds its --help from it); resolving a device does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_memory(value: int | float | str) -> int | float:
    """'2GiB' / '512Mi' / 1e9 → bytes (int); a number in (0, 1] → a fraction of free device memory."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"kv_cache_memory: must be positive, got {value}")
        return float(value) if value <= 1 else int(value)
    text = str(value).strip()
    m = re.fullmatch(r"([0-9.]+)\s*([kKmMgGtT]i?)?[bB]?", text)
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (examples: 2GiB, 512Mi, 0.9)")
    number = float(m.group(1))
    unit = (m.group(2) or "").lower()
    if not unit and number <= 1:
        return number
    return int(number * _UNITS[unit])


@dataclass
class EngineOptions:
    runtime: str = "paged"
    device: str = "auto"
    dtype: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | float | str | None = None
    num_kv_blocks: int | None = None  # exact pool size; overrides kv_cache_memory (tests)
    max_model_len: int | None = None
    kv_manager: str | None = None  # cpu-int8: "paged" or "radix" (default radix)
    skip_quality_gate: bool = False  # cpu-int8: serve even if the int8 quality gate fails
    quantize_head: bool = False  # cpu-int8: int8 output head too (embeddings stay float)
    quant_scale_multiplier: float = 1.0  # cpu-int8 test hook: != 1 stores wrong scales, the gate must fail

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

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        return getattr(torch, self.dtype)

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
