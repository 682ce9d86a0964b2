"""The numbers `inferplane bench serve` reports, from per-request records; and its arrival schedule.

Definitions (as vLLM's `bench serve` has them, so figures compare):
- TTFT: request sent to the first chunk that carries output text;
- ITL: the gaps between consecutive text-carrying chunks, pooled over all requests (a chunk may
  carry several tokens: a server that batches its stream shows fewer, longer gaps);
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), for requests of at least 2 tokens;
- E2E: request sent to the stream's end;
- throughputs: completed requests and their tokens over the run's duration (first request sent to
  the last one finished);
- goodput: completed requests that meet every given SLO, per second of the same duration.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")  # vLLM's --goodput names, in milliseconds


@dataclass
class RequestRecord:
    """One request's outcome. Seconds: `start` after the run's start, `ttft` and `e2e` after `start`."""

    index: int
    conversation: int
    turn: int
    output_len: int  # asked for (max_tokens)
    start: float = 0.0
    ok: bool = False
    error: str = ""
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    token_source: str = "chunks"  # "usage": the server's count; "chunks": text chunks counted
    chunks: int = 0
    output_chars: int = 0
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def as_json(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each of `count` arrivals comes: a Poisson process of
    `rate` per second (exponential gaps, the first one included), or all at 0 for rate inf."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be positive or inf, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): p0 is the min, p100 the max."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(seconds: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 in milliseconds (NaN where there is nothing to measure)."""
    ms = [s * 1000 for s in seconds]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return out


def parse_slos(items: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be positive")
    return slos


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a completed request is within every SLO (a 1-token answer has no TPOT to miss)."""
    if not record.ok:
        return False
    measured = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2e}
    return all(measured[k] is None or measured[k] * 1000 <= limit for k, limit in slos.items())


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float]) -> dict:
    """The run's figures (see the module's docstring); `duration` in seconds."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "input_tokens_from_server": sum(r.prompt_tokens is not None for r in done),
        "output_tokens_from_usage": sum(r.token_source == "usage" for r in done),
        "short_of_output_len": sum(r.output_tokens < r.output_len for r in done),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(sum(meets(r, slos) for r in done)) if slos else None,
        "slos_ms": slos,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
    }
