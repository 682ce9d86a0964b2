"""Limits on the sequences a key, and all of a tenant's keys together, have in flight at once.

A rate limit bounds how fast requests arrive; this bounds how many run, which is what takes a
replica's slots and KV blocks: a tenant with long generations could fill every replica at a modest
request rate. A request holds `choices` sequences (prompts × n) from admission (the gateway's
`prepare`, before routing) until it is settled, whatever way it ends.

A request that alone asks for more than a limit is a 400 naming `n` (`RequestTooLarge`): waiting
would never help. One that would take the total over a limit is a 429 (`ConcurrencyLimited`) and
holds nothing.

`InProcessSequenceLimiter` counts in this process (the embedded default: N gateway replicas admit up
to N times a limit); `shared_concurrency.RedisSequenceLimiter` counts in Redis, so a limit holds
across replicas, with leases so that a crashed gateway's holds expire. The gateway talks to either
through `SequenceLimiter`, as it does to the rate limiters (limits.py).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from inferplane.control_plane.errors import ConcurrencyLimited, RequestTooLarge

# There is no telling when a sequence in flight ends: a client retries after this long.
RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class SequenceLimits:
    """The limits a request is admitted under; None means none. `Principal` carries both."""

    key: int | None = None
    tenant: int | None = None

    @property
    def any(self) -> bool:
        return self.key is not None or self.tenant is not None


@dataclass
class SequenceHold:
    """What an admitted request holds, to be given back once (`SequenceLimiter.release`)."""

    key_id: str | None
    tenant_id: str | None
    sequences: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    local: bool = True  # counted in this process (always so without Redis; a fallback with it)
    released: bool = False


class SequenceLimiter(Protocol):
    """What the gateway's request path needs from a concurrency limiter, wherever it counts."""

    async def acquire(self, key_id: str | None, tenant_id: str | None, limits: SequenceLimits,
                      sequences: int) -> SequenceHold | None:
        """Holds `sequences`, or raises (nothing held then); None when no limit applies."""
        ...

    def release(self, hold: SequenceHold) -> None:
        """Gives a hold back; a second call does nothing. Never raises, never blocks (it runs in a
        stream's `finally`, possibly while the stream is cancelled)."""
        ...


def check_fits(limits: SequenceLimits, sequences: int) -> None:
    """400 naming `n` when the request alone exceeds a limit."""
    for scope, limit in (("key", limits.key), ("tenant", limits.tenant)):
        if limit is not None and sequences > limit:
            raise RequestTooLarge(f"the request asks for {sequences} sequences (prompts × n); this {scope} may run "
                                  f"at most {limit} at once", param="n")


def refused(scope: str, limit: int, held: int) -> ConcurrencyLimited:
    """The 429 for a limit that the request would take past what is held."""
    return ConcurrencyLimited(f"this {scope} has {held} of its {limit} concurrent sequences in flight; retry when "
                              "one ends", retry_after=RETRY_AFTER_S)


class SequenceCounter:
    """Sequences held per key and per tenant in this process, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}

    def held(self, scope: str, owner: str) -> int:
        return self._held.get((scope, owner), 0)

    def acquire(self, key_id: str | None, tenant_id: str | None, limits: SequenceLimits,
                sequences: int) -> SequenceHold:
        """Admits both scopes or neither. Scopes without a limit are not counted: a limit set later
        counts from the requests admitted after it."""
        check_fits(limits, sequences)
        scopes = [(scope, owner, limit) for scope, owner, limit in (("key", key_id, limits.key),
                                                                     ("tenant", tenant_id, limits.tenant))
                  if owner is not None and limit is not None]
        with self._lock:
            for scope, owner, limit in scopes:
                held = self.held(scope, owner)
                if held + sequences > limit:
                    raise refused(scope, limit, held)
            for scope, owner, _ in scopes:
                self._held[(scope, owner)] = self.held(scope, owner) + sequences
        counted = {scope for scope, _, _ in scopes}
        return SequenceHold(key_id if "key" in counted else None, tenant_id if "tenant" in counted else None,
                            sequences)

    def release(self, hold: SequenceHold) -> None:
        with self._lock:
            for scope, owner in (("key", hold.key_id), ("tenant", hold.tenant_id)):
                if owner is None:
                    continue
                left = self.held(scope, owner) - hold.sequences
                if left > 0:
                    self._held[(scope, owner)] = left
                else:
                    self._held.pop((scope, owner), None)


class InProcessSequenceLimiter:
    """`SequenceCounter` behind `SequenceLimiter`: the embedded default, limits per gateway replica."""

    def __init__(self, counter: SequenceCounter | None = None):
        self.counter = counter or SequenceCounter()

    async def acquire(self, key_id: str | None, tenant_id: str | None, limits: SequenceLimits,
                      sequences: int) -> SequenceHold | None:
        if not limits.any:
            return None
        return self.counter.acquire(key_id, tenant_id, limits, sequences)

    def release(self, hold: SequenceHold) -> None:
        if not hold.released:
            hold.released = True
            self.counter.release(hold)
