"""Concurrent-sequence limits that hold across gateway replicas: holds in Redis, under leases.

Each limited scope (a key; a tenant) is a Redis sorted set of its holds: the member is
`<sequences>:<hold id>`, the score the time its lease runs out. A Lua script (atomic in Redis)
drops expired holds, sums the rest and adds the new hold to every limited scope, or to none, so
two replicas admitting at once cannot both take the last sequence. Time is Redis's own (`TIME`).

Leases are what make a crashed gateway's holds go away: each replica renews the holds of its
requests in flight every third of a lease, and a hold nobody renews expires after `lease` seconds.
A renewal never brings back a hold that expired (a slow Redis may have let another request take
its place). A released hold is removed at once, off the request path.

Both scopes of a request carry its tenant id as their hash tag, so one script sees both in Redis
Cluster. When Redis fails, `failure` decides as for the rate limits (shared_limits.StoreFailures):
"open" counts in this process meanwhile, "closed" answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Literal

import redis.asyncio as redis
from redis.exceptions import RedisError

from inferplane.control_plane.concurrency import SequenceCounter, SequenceHold, SequenceLimits, check_fits, refused
from inferplane.control_plane.shared_limits import StoreFailures

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger(__name__)

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lease = tonumber(ARGV[1])
"""
# KEYS: the key's set, the tenant's set. ARGV: lease ms, member, sequences, key limit (0: none),
# tenant limit (0: none). Returns {0, 0} when held, else {1 (key) or 2 (tenant), sequences held}.
_ACQUIRE = _NOW + """
local member, need = ARGV[2], tonumber(ARGV[3])
local limits = {tonumber(ARGV[4]), tonumber(ARGV[5])}
for i = 1, 2 do
  if limits[i] > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    local held = 0
    for _, m in ipairs(redis.call('ZRANGE', KEYS[i], 0, -1)) do
      held = held + tonumber(string.match(m, '^(%d+):'))
    end
    if held + need > limits[i] then return {i, held} end
  end
end
for i = 1, 2 do
  if limits[i] > 0 then
    redis.call('ZADD', KEYS[i], now + lease, member)
    redis.call('PEXPIRE', KEYS[i], lease * 2)
  end
end
return {0, 0}
"""
# KEYS: the sets the hold may be in. ARGV: lease ms, member. Extends the lease of a hold still there.
_RENEW = _NOW + """
for i = 1, #KEYS do
  if redis.call('ZSCORE', KEYS[i], ARGV[2]) then
    redis.call('ZADD', KEYS[i], now + lease, ARGV[2])
    redis.call('PEXPIRE', KEYS[i], lease * 2)
  end
end
return 1
"""


class RedisSequenceLimiter:
    """`SequenceLimiter` with its holds in Redis (see the module docstring)."""

    def __init__(self, url: str, *, failure: Literal["open", "closed"] = "open", lease: float = 30.0,
                 prefix: str = "inferplane:sequences", timeout: float = 0.5, errors: Counter | None = None,
                 fallback: SequenceCounter | None = None):
        self._failures = StoreFailures(failure, errors)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self.lease = lease
        self._prefix = prefix
        self.fallback = fallback or SequenceCounter()
        self._live: dict[str, SequenceHold] = {}  # holds in Redis that this replica renews
        self._renewer: asyncio.Task | None = None
        self._releasing: set[asyncio.Task] = set()

    def _keys(self, hold: SequenceHold) -> list[str]:
        return [self._key("key", hold.key_id, hold.tenant_id), self._key("tenant", hold.tenant_id, hold.tenant_id)]

    def _key(self, scope: str, owner: str | None, tenant_id: str | None) -> str:
        # The tenant id as hash tag: a request's two sets in one Redis Cluster slot.
        return f"{self._prefix}:{{{tenant_id or ''}}}:{scope}:{owner or ''}"

    @staticmethod
    def _member(hold: SequenceHold) -> str:
        return f"{hold.sequences}:{hold.id}"

    async def acquire(self, key_id: str | None, tenant_id: str | None, limits: SequenceLimits,
                      sequences: int) -> SequenceHold | None:
        key_limit = limits.key if key_id is not None else None
        tenant_limit = limits.tenant if tenant_id is not None else None
        if key_limit is None and tenant_limit is None:
            return None
        check_fits(limits, sequences)
        hold = SequenceHold(key_id, tenant_id, sequences, local=False)
        try:
            verdict, held = await self._acquire(keys=self._keys(hold), args=[
                int(self.lease * 1000), self._member(hold), sequences, key_limit or 0, tenant_limit or 0])
        except (RedisError, OSError) as exc:
            self._failures.failed(exc)
            return self.fallback.acquire(key_id, tenant_id, limits, sequences)
        if int(verdict) == 1:
            raise refused("key", key_limit or 0, int(held))
        if int(verdict) == 2:
            raise refused("tenant", tenant_limit or 0, int(held))
        self._live[hold.id] = hold
        self._start_renewing()
        return hold

    def release(self, hold: SequenceHold) -> None:
        if hold.released:
            return
        hold.released = True
        if hold.local:
            self.fallback.release(hold)
            return
        self._live.pop(hold.id, None)
        task = asyncio.get_running_loop().create_task(self._remove(hold))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _remove(self, hold: SequenceHold) -> None:
        try:
            for key in self._keys(hold):  # a set the hold is not in is left as it is
                await self.client.zrem(key, self._member(hold))
        except (RedisError, OSError) as exc:  # the hold then lasts until its lease runs out
            self._failures.failed(exc, refuse=False)

    async def released(self) -> None:
        """Waits until the holds released so far are gone from Redis (tests; shutdown)."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)

    def _start_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                await self.renew()
            except (RedisError, OSError) as exc:
                self._failures.failed(exc, refuse=False)

    async def renew(self) -> None:
        """Extends the lease of every hold this replica has in flight (one pipelined round trip)."""
        holds = list(self._live.values())
        if not holds:
            return
        pipe = self.client.pipeline(transaction=False)
        lease_ms = int(self.lease * 1000)
        for hold in holds:
            await self._renew(keys=self._keys(hold), args=[lease_ms, self._member(hold)], client=pipe)
        await pipe.execute()

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.released()
        await self.client.aclose()
