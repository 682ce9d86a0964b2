"""The KV memory one long context holds in a model with sliding-window layers, against what it
would hold if those layers kept the whole context (as before kv/window.py): a bench figure."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WindowKV:
    context: int
    window: int
    held_bytes: int  # after the prompt is computed: main blocks whole, window blocks one window
    peak_bytes: int  # the most held at once, a prefill chunk's transient window blocks included
    no_window_bytes: int  # the same main blocks in every layer

    @property
    def ratio(self) -> float:
        return self.held_bytes / self.no_window_bytes

    def line(self) -> str:
        mib = 1 << 20
        return (f"KV memory of one {self.context}-token context (window {self.window}): "
                f"{self.held_bytes / mib:.1f} MiB held, {self.peak_bytes / mib:.1f} MiB at peak, against "
                f"{self.no_window_bytes / mib:.1f} MiB with every layer keeping the whole context: "
                f"{self.ratio:.3f}x (goal <= 0.3x: {'met' if self.ratio <= 0.3 else 'MISSED'})")


def measure_window_kv(engine, context: int, seed: int = 0) -> WindowKV | None:
    """Computes one `context`-token prompt on `engine` (an idle one) and reads the pools while the
    sequence still runs; None for a model without window layers."""
    from inferplane.worker.engine.sampling import SamplingParams

    if not engine.pools.window_layers:
        return None
    vocab = engine.loaded.config.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while not seq.output_token_ids:
        engine.step()
    stats = engine.stats()
    per_main, per_window = engine.pools.block_bytes
    figures = WindowKV(
        context=context, window=engine.pools.window,
        held_bytes=int(stats["blocks_used"] * per_main + stats["window_blocks_used"] * per_window),
        peak_bytes=int(stats["peak_blocks_used"] * per_main + stats["window_peak_blocks_used"] * per_window),
        no_window_bytes=int(stats["blocks_used"] * (per_main + per_window)))
    while engine.has_unfinished():
        engine.step()
    return figures
