"""The engine's parts for a runtime: its KV manager, scheduler ordering and weight format.

What each runtime is made of is one entry of `inferplane.api.resolve.PRESETS`, so `LLM(runtime=...)`,
`inferplane worker --runtime` and the operator agree on what each name means; this module builds
the parts an entry names:

- paged:    PagedKV, first-come-first-served, dense weights.
- radix:    RadixKV (prefix tree over the block pool), cache-aware ordering, dense weights.
- cpu-int8: int8 weight-only/dynamic linear layers on the CPU; its KV manager is the preset's
            (radix) unless the `kv_manager` option names another.
- embedding: no engine parts here: an encoder model's batched forward (worker/embedding/), no KV.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from inferplane.api.resolve import PRESETS
from inferplane.worker.engine.kv.manager import KVManager
from inferplane.worker.engine.kv.paged import PagedKV
from inferplane.worker.engine.kv.tiers.link import TierLink
from inferplane.worker.engine.kv.window import WindowBlocks
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.scheduler import Scheduler
from inferplane.worker.ops import native
from inferplane.worker.ops.native.choice import NEVER

_RADIX_MODULE = "inferplane.worker.engine.kv.radix"
_QUANT_MODULE = "inferplane.worker.quant.convert"


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def available_runtimes() -> tuple[str, ...]:
    """The presets whose parts are installed (radix and int8 live in modules of their own)."""
    needs = {"radix": _RADIX_MODULE, "int8": _QUANT_MODULE}
    return tuple(name for name, preset in PRESETS.items()
                 if all(_module_exists(needs[part]) for part in (preset.kv_manager, preset.weights) if part in needs))


def check_runtime(name: str) -> None:
    runtimes = available_runtimes()
    if name not in runtimes:
        raise ValueError(f"runtime: {name!r} is not available; choose one of {', '.join(runtimes)}")


def kv_manager_kind(options: EngineOptions) -> str | None:
    """'paged' or 'radix': the KV manager a runtime uses (None: the embedding runtime keeps no KV)."""
    preset = PRESETS[options.runtime]
    if preset.kv_manager is None:
        return None
    kind = (options.kv_manager or preset.kv_manager) if preset.weights == "int8" else preset.kv_manager
    if kind not in ("paged", "radix"):
        raise ValueError(f"kv_manager: must be 'paged' or 'radix', got {kind!r}")
    return kind


def build_kv_manager(options: EngineOptions, num_blocks: int, windows: WindowBlocks | None = None,
                     tiers: TierLink | None = None) -> KVManager:
    check_runtime(options.runtime)
    kind = kv_manager_kind(options)
    if kind is None:
        raise ValueError(f"runtime: {options.runtime} serves embedding models and builds no generation engine")
    if kind == "radix":
        from inferplane.worker.engine.kv.events import KVEventLog
        from inferplane.worker.engine.kv.radix import RadixKV

        events = KVEventLog(options.block_size) if options.kv_events is not False else None
        if tiers is not None and events is not None:
            tiers.store.publish_to(events)
        return RadixKV(num_blocks, options.block_size, windows, tiers, events)
    if options.kv_events:
        raise ValueError("kv_events: KV events need the radix KV manager (runtime radix or cpu-int8), "
                         "which keeps finished blocks; paged frees them")
    if tiers is not None:
        raise ValueError("kv_offload_memory: KV tiers need the radix KV manager (runtime radix or cpu-int8), "
                         "which keeps finished blocks; paged frees them")
    return PagedKV(num_blocks, options.block_size, windows)


def build_scheduler(options: EngineOptions, kv: KVManager) -> Scheduler:
    if kv_manager_kind(options) == "radix":
        from inferplane.worker.engine.radix_scheduler import RadixScheduler

        return RadixScheduler(kv, options.max_num_seqs, options.max_num_batched_tokens, options.step_target_ms / 1000)
    return Scheduler(kv, options.max_num_seqs, options.max_num_batched_tokens, options.step_target_ms / 1000)


def prepare_weights(options: EngineOptions, loaded) -> dict[str, float]:
    """Converts the loaded model's weights to the runtime's format in place; returns figures to
    report (weight bytes, quality-gate results, the measured head-kernel crossover). On the CPU,
    it also times the float head's C kernel against PyTorch (model.measure_head_kernel)."""
    figures: dict[str, float] = {}
    if PRESETS[options.runtime].weights == "int8":
        from inferplane.worker.quant.convert import quantize_loaded_model
        from inferplane.worker.quant.weight_arena import place_decode_weights

        figures.update(quantize_loaded_model(loaded, options))
        figures.update(place_decode_weights(loaded.model))  # before the head's timing below: its final memory
    measure = getattr(loaded.model, "measure_head_kernel", None)
    if measure is not None:
        crossover = measure()
        if crossover < NEVER:
            figures["head_kernel_torch_from_rows"] = float(crossover)
    return figures


def kernel_isas(model: nn.Module) -> dict[str, str]:
    """Kernel name -> the ISA it runs on for this model ("torch": PyTorch's op does that job):
    what the C kernels cover, less what this model or the start-up measurements left to PyTorch."""
    isas = native.kernel_isas(native.kernels())
    gelu = getattr(getattr(model, "config", None), "hidden_act", "silu") == "gelu_tanh"
    isas.pop("silu_mul" if gelu else "gelu_mul", None)  # the gated MLP's activation this model has
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        for kind in native.BLOCK_KINDS.values():
            isas.pop(f"{kind}_linear", None)
        return dict.fromkeys(isas, "torch")
    kinds = {getattr(m, "kind", None): getattr(m, "is_packed", False) for m in model.modules() if hasattr(m, "kind")}
    if not kinds.get("int8"):  # no Int8Linear on the C kernel (none, or on PyTorch's ops)
        isas["int8_linear"] = "torch"
    for kind in native.BLOCK_KINDS.values():  # only a model with layers from a file's own blocks uses them
        if kind not in kinds:
            isas.pop(f"{kind}_linear", None)
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or getattr(getattr(model, "head_kernel", None), "torch_from_rows", NEVER) <= 1:
        isas["f32_linear"] = "torch"
    return isas
