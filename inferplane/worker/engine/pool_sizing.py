"""How big the KV pools are: the main pool's blocks, the sliding-window pool's, and the room the
decode graphs' activations take from the same memory budget.

Decided once, before the engine builds its KV cache: the budget (`kv_cache_memory`, bytes or a
fraction of the GPU's free memory, or `num_kv_blocks` outright) is spent on blocks, after the graphs'
pool is taken out of it, and never on more blocks than every sequence slot could fill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferplane.worker.engine.decode_graphs import activation_bytes
from inferplane.worker.engine.kv.block_pool import blocks_for
from inferplane.worker.engine.kv.window import window_pool_blocks
from inferplane.worker.engine.options import EngineOptions, parse_memory
from inferplane.worker.model.loader import LoadedModel
from inferplane.worker.ops.kv_cache import PagedKVCache


@dataclass(frozen=True)
class PoolSizes:
    """What `size_pools` decided."""

    cache_shape: dict  # PagedKVCache's arguments but the block counts
    window_layers: frozenset[int]  # layers whose KV goes to the window pool (kv/window.py)
    window: int | None  # their window; None where the model has no window pool
    uses_graphs: bool  # decode steps replay CUDA graphs (decode_graphs.py)
    graph_reserve: int  # bytes the graphs' pool takes from the KV budget
    num_blocks: int  # the main pool (every layer but the window ones)
    num_window_blocks: int  # the window pool (0 without window layers)
    block_bytes: tuple[int, int]  # bytes of one block of the main pool and of the window pool


def size_pools(loaded: LoadedModel, options: EngineOptions, device: torch.device, kv_dtype: torch.dtype,
               max_model_len: int) -> PoolSizes:
    """The KV pools for this model, options (settled) and device."""
    config = loaded.config
    window_layers, window = _window_layers(loaded, max_model_len)
    shape = dict(num_layers=config.num_layers, block_size=options.block_size, num_kv_heads=config.num_kv_heads,
                 head_dim=config.head_dim, dtype=kv_dtype, device=device, window_layers=window_layers)
    graphs = uses_graphs(loaded, options, device)
    # what the graphs' pool will hold, taken from the KV budget before the pool is sized
    reserve = activation_bytes(loaded.model, shape, options.max_num_seqs) if graphs else 0
    block_bytes = tuple(PagedKVCache.bytes_per_block(layers, options.block_size, config.num_kv_heads,
                                                     config.head_dim, kv_dtype)
                        for layers in (config.num_layers - len(window_layers), len(window_layers)))
    num_blocks, num_window_blocks = _num_blocks(options, device, max_model_len, window, len(window_layers),
                                                block_bytes, reserve)
    return PoolSizes(cache_shape=shape, window_layers=window_layers, window=window, uses_graphs=graphs,
                     graph_reserve=reserve, num_blocks=num_blocks, num_window_blocks=num_window_blocks,
                     block_bytes=block_bytes)


def uses_graphs(loaded: LoadedModel, options: EngineOptions, device: torch.device) -> bool:
    """Decode steps replay CUDA graphs (decode_graphs.py) on a GPU unless enforce_eager asks
    not to, or the model has parts whose work depends on the data: LoRA adapters (rows tagged
    per step) and Mixture-of-Experts layers (rows grouped by the experts chosen) run eagerly."""
    config = loaded.config
    return (device.type == "cuda" and not options.enforce_eager and not options.max_loras
            and not any(config.is_moe_layer(i) for i in range(config.num_layers)))


def _window_layers(loaded: LoadedModel, max_model_len: int) -> tuple[frozenset[int], int | None]:
    """The sliding-window layers whose window is shorter than the context, and that window: their
    KV goes to the window pool, where each sequence holds one window (kv/window.py)."""
    config = loaded.config
    window = config.sliding_window
    if window is None or window >= max_model_len:
        return frozenset(), None
    layers = frozenset(i for i in range(config.num_layers) if config.layer_window(i) is not None)
    return layers, (window if layers else None)


def _num_blocks(options: EngineOptions, device: torch.device, max_model_len: int, window: int | None,
                num_window: int, block_bytes: tuple[int, int], graph_reserve: int) -> tuple[int, int]:
    """Blocks of the main pool and of the window pool (0 without window layers).

    The window pool gets what `window_pool_blocks` proves enough for max_num_seqs sequences (it
    can never bind before the main pool then), or as many blocks as the main pool where that is
    fewer; the main pool gets the rest of the memory budget."""
    per_full, per_window = block_bytes
    window_need = (window_pool_blocks(window, options.block_size, options.max_num_seqs,
                                      options.max_num_batched_tokens) if num_window else 0)
    # No point in more blocks than every sequence slot could fill at full context.
    cap = blocks_for(max_model_len, options.block_size) * options.max_num_seqs
    if options.num_kv_blocks is not None:
        num_blocks = int(options.num_kv_blocks)
        return num_blocks, min(num_blocks + 1, window_need)
    amount = parse_memory(options.kv_cache_memory)
    if isinstance(amount, float):
        if device.type != "cuda":
            raise ValueError("kv_cache_memory: a fraction of free memory needs a GPU; give bytes (e.g. 1GiB)")
        free, _ = torch.cuda.mem_get_info(device)
        amount = int(free * amount) - graph_reserve
    if not num_window:
        return max(1, min(amount // per_full, cap)), 0
    if not per_full:  # every layer slides: the main pool only counts blocks, it holds nothing
        return cap, max(2, min(amount // per_window, window_need))
    num_blocks = min((amount - window_need * per_window) // per_full, cap)
    if num_blocks + 1 < window_need:  # a small budget: as many window blocks as main ones
        num_blocks = min(amount // (per_full + per_window), cap)
        return max(1, num_blocks), max(1, num_blocks) + 1
    return num_blocks, window_need
