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
    """The buffer is read from memory of the weights' kind (a weight arena: 2 MiB-aligned, advised
    for huge pages), and how much of it the kernel backed with huge pages is reported."""
    reader = ReadBandwidth(threads=2)
    assert reader.size >= 512 * 2**20 and reader.reads == 0
    assert reader._buffer.data_ptr() == reader._arena.address and reader._arena.address % (2 * 2**20) == 0
    assert reader._buffer.nbytes == reader.size and bool(reader._buffer.eq(1.0).all())
    assert 0 <= reader.huge_page_bytes <= reader.size
    reader.measure()
    reader.measure(reads=2)
    assert reader.reads == 3 and 0 < reader.best_seconds < float("inf")
    assert reader.bytes_per_second == reader.size / reader.best_seconds
    assert reader.best_seconds <= reader.worst_seconds and reader.slowest_bytes_per_second <= reader.bytes_per_second


def test_a_decode_timing_disturbed_below_the_one_token_run_gives_no_figure():
    """t(G) <= t(1) (the one-token run was slowed by something else) is not a decode rate: nan, not
    tokens over a clamped near-zero time."""
    def slow_first(n: int) -> None:
        time.sleep(0.05 if n == 1 else 0.001)

    assert math.isnan(decode_rates({"a": slow_first}, batch=1, new_tokens=4, repeats=2)["a"])


class _Reads:
    """A ReadBandwidth stand-in whose reads return the given rates in turn."""

    def __init__(self, rates: list[float]):
        self.rates = iter(rates)

    def read(self) -> float:
        return next(self.rates)


def test_each_decode_timing_is_judged_against_the_faster_read_of_its_own_moment():
    from inferplane.bench.bound import paired_fractions

    def generate(n: int) -> None:
        time.sleep(0.02 * n)  # 20 ms a token: G = 4 gives 3 tokens over 60 ms more than one token

    # Round 1 between reads of 100 and 300 bytes/s, round 2 between 300 and 200.
    paired = paired_fractions(generate, _Reads([100.0, 300.0, 300.0, 200.0]), bytes_per_token=3.0,
                              new_tokens=4, rounds=2)
    # 3 tokens over about 60 ms is at most 50 tokens/s; x 3 bytes over the faster read, 300 bytes/s
    assert len(paired.fractions) == 2 and all(0 < f <= 0.5 * 1.01 for f in paired.fractions)
    assert paired.best == max(paired.fractions) and paired.median == sum(paired.fractions) / 2


def test_a_paired_timing_disturbed_below_the_one_token_run_gives_no_figure():
    from inferplane.bench.bound import paired_fractions

    def generate(n: int) -> None:
        time.sleep(0.05 if n == 1 else 0.001)  # every one-token run slowed by something else

    paired = paired_fractions(generate, _Reads([1.0] * 4), bytes_per_token=1.0, new_tokens=4, rounds=2)
    assert len(paired.fractions) == 2 and all(math.isnan(f) for f in paired.fractions)
    assert math.isnan(paired.best) and math.isnan(paired.median)
