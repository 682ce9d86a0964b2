"""Key rate limits that hold across gateway replicas: token buckets in Redis.

Each bucket is a Redis hash (level, time of the last update) changed only by Lua scripts, which
Redis runs atomically, so two replicas admitting the same key at once cannot both take the last
token. The scripts read Redis's own clock (`TIME`), so replicas with skewed clocks agree. Buckets
expire after two idle periods (by then they would be full again). Keys carry the API key's id in a
hash tag, so both of a request's buckets live in one Redis Cluster slot.

When Redis cannot be reached, `failure` decides: "open" (the default) falls back to this replica's
in-process buckets, so limits still hold per replica, as without Redis; "closed" refuses the
request with 503 `rate_limiter_unavailable`. Either way the error is logged (at most every 10 s)
and counted (the gateway's `inferplane_gateway_limiter_store_errors_total`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Literal

import redis.asyncio as redis
from redis.exceptions import RedisError

from inferplane.control_plane.errors import RateLimited, RequestTooLarge, ServiceUnavailable
from inferplane.control_plane.limits import KeyLimits, RateLimiter

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger(__name__)

_REFILL = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local period = tonumber(ARGV[1])
local function level(key, capacity)
  local fields = redis.call('HMGET', key, 'level', 'ts')
  local value, updated = tonumber(fields[1]), tonumber(fields[2])
  if value == nil then return capacity end
  if now > updated then value = math.min(capacity, value + (now - updated) * capacity / period) end
  return value
end
local function store(key, value)
  redis.call('HSET', key, 'level', tostring(value), 'ts', now)
  redis.call('PEXPIRE', key, period * 2)
end
"""
# KEYS: request bucket, token bucket. ARGV: period ms, request capacity (0: none), token capacity
# (0: none), tokens needed. Returns {0, "0"} when admitted (both taken), else {1 or 2, wait ms}.
_ADMIT = _REFILL + """
local req_cap, tok_cap, need = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local req_level, tok_level
if req_cap > 0 then
  req_level = level(KEYS[1], req_cap)
  if req_level < 1 then return {1, tostring((1 - req_level) * period / req_cap)} end
end
if tok_cap > 0 then
  tok_level = level(KEYS[2], tok_cap)
  if tok_level < need then return {2, tostring((need - tok_level) * period / tok_cap)} end
end
if req_cap > 0 then store(KEYS[1], req_level - 1) end
if tok_cap > 0 and need > 0 then store(KEYS[2], tok_level - need) end
return {0, "0"}
"""
# KEYS: token bucket. ARGV: period ms, capacity, tokens to take (negative: refund, up to full).
_ADJUST = _REFILL + """
local capacity, amount = tonumber(ARGV[2]), tonumber(ARGV[3])
store(KEYS[1], math.min(capacity, level(KEYS[1], capacity) - amount))
return 1
"""


class LimiterUnavailable(ServiceUnavailable):
    """503: the shared rate-limit store is unreachable and the gateway is configured to fail closed."""

    status = 503
    code = "rate_limiter_unavailable"


class StoreFailures:
    """How a limiter backed by Redis meets Redis failing: counted (by failure mode), logged at most
    every 10 s, and with failure "closed" refused with a 503. Shared by the rate limiter here and
    the sequence limiter (shared_concurrency.py), which answer an outage alike."""

    def __init__(self, failure: Literal["open", "closed"], errors: Counter | None = None):
        if failure not in ("open", "closed"):
            raise ValueError(f"failure: must be 'open' or 'closed', got {failure!r}")
        self.failure = failure
        self._errors = errors
        self._last_warning = 0.0

    def failed(self, exc: Exception, *, refuse: bool = True) -> None:
        """Records a failed store call; raises `LimiterUnavailable` when `refuse` and failing closed."""
        if self._errors is not None:
            self._errors.labels(self.failure).inc()
        now = time.monotonic()
        if now - self._last_warning > 10:
            self._last_warning = now
            action = "refusing requests" if self.failure == "closed" else "limiting per replica meanwhile"
            log.warning("rate-limit store unreachable (%s); %s", exc, action)
        if refuse and self.failure == "closed":
            raise LimiterUnavailable("the rate limiter is unavailable; retry shortly") from exc


class RedisKeyLimiter:
    """`KeyLimiter` with its buckets in Redis (see the module docstring for failure handling)."""

    def __init__(self, url: str, *, failure: Literal["open", "closed"] = "open", period: float = 60.0,
                 prefix: str = "inferplane:ratelimit", timeout: float = 0.5,
                 fallback: RateLimiter | None = None, errors: Counter | None = None):
        self._failures = StoreFailures(failure, errors)
        self.failure = failure
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._admit = self.client.register_script(_ADMIT)
        self._adjust = self.client.register_script(_ADJUST)
        self._period_ms = int(period * 1000)
        self._prefix = prefix
        self.fallback = fallback or RateLimiter(period=period)

    def _key(self, key_id: str, kind: str, capacity: int | None) -> str:
        # The capacity is part of the key, so changing a key's limit starts a fresh bucket.
        return f"{self._prefix}:{{{key_id}}}:{kind}:{capacity or 0}"

    async def admit(self, key_id: str, limits: KeyLimits, *, tokens: int) -> None:
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm is None and tpm is None:
            return
        if tpm is not None and tokens > tpm:
            raise RequestTooLarge(f"request needs {tokens} tokens; this key allows {tpm} tokens per minute")
        keys = [self._key(key_id, "req", rpm), self._key(key_id, "tok", tpm)]
        try:
            verdict, wait_ms = await self._admit(keys=keys, args=[self._period_ms, rpm or 0, tpm or 0,
                                                                  max(tokens, 0)])
        except (RedisError, OSError) as exc:
            self._store_failed(exc)
            self.fallback.admit(key_id, limits, tokens=tokens)
            return
        if int(verdict) == 1:
            raise RateLimited(f"rate limit of {rpm} requests per minute reached", retry_after=float(wait_ms) / 1000)
        if int(verdict) == 2:
            raise RateLimited(f"rate limit of {tpm} tokens per minute reached", retry_after=float(wait_ms) / 1000)

    async def adjust(self, key_id: str, limits: KeyLimits, tokens: int) -> None:
        tpm = limits.tokens_per_minute
        if tpm is None or tokens == 0:
            return
        try:
            await self._adjust(keys=[self._key(key_id, "tok", tpm)], args=[self._period_ms, tpm, tokens])
        except (RedisError, OSError) as exc:  # a lost refund only makes the key wait a little longer
            self._store_failed(exc, refuse=False)
            self.fallback.adjust(key_id, limits, tokens)

    def _store_failed(self, exc: Exception, *, refuse: bool = True) -> None:
        self._failures.failed(exc, refuse=refuse)

    async def close(self) -> None:
        await self.client.aclose()
