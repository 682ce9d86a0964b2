"""bench cpu's interleaving: every contender and the bandwidth read take a turn in each round, so the
bound that batch-1 decode is compared with is measured over the same minutes as the decode."""

from __future__ import annotations

import math
import time

from inferplane.bench.bandwidth import ReadBandwidth
from inferplane.bench.cpu import decode_rates


def test_the_bandwidth_read_takes_a_turn_in_every_round_after_the_contenders():
    turns: list[str] = []

    def contender(name: str):
        def generate(n: int) -> None:
            turns.append(f"{name}:{n}")
            time.sleep(0.002 * n)  # a step's time: the figure is tokens over the extra steps' time
        return generate

    rates = decode_rates({"a": contender("a"), "b": contender("b")}, batch=1, new_tokens=4, repeats=3,
                         each_round=lambda: turns.append("read"))
    assert set(rates) == {"a", "b"} and all(rate > 0 for rate in rates.values())
    warm_up, rounds = turns[:2], turns[2:]
    assert all(rate < 1 / 0.002 * 1.01 for rate in rates.values())  # 3 tokens over at least 6 ms
    assert warm_up == ["a:4", "b:4"]
    assert rounds == ["a:1", "a:4", "b:1", "b:4", "read"] * 3


def test_read_bandwidth_keeps_the_fastest_read_of_a_buffer_larger_than_the_cache():
    reader = ReadBandwidth(threads=2)
    assert reader.size >= 512 * 2**20 and reader.reads == 0
    reader.measure()
    reader.measure(reads=2)
    assert reader.reads == 3 and 0 < reader.best_seconds < float("inf")
    assert reader.bytes_per_second == reader.size / reader.best_seconds


def test_a_decode_timing_disturbed_below_the_one_token_run_gives_no_figure():
    """t(G) <= t(1) (the one-token run was slowed by something else) is not a decode rate: nan, not
    tokens over a clamped near-zero time."""
    def slow_first(n: int) -> None:
        time.sleep(0.05 if n == 1 else 0.001)

    assert math.isnan(decode_rates({"a": slow_first}, batch=1, new_tokens=4, repeats=2)["a"])
