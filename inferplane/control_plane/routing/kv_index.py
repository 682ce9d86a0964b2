"""The gateway's index of which replica holds which KV block, and where, from the workers' KV events.

Each gateway replica keeps its own, fed by a stream per worker (kv_events.py) that starts with a
snapshot, so replicas converge without sharing state and a restarted gateway knows everything again
as soon as its streams open. Keys are the workers' block names (api/kv_blocks.py), which the gateway
computes for a prompt itself (prefix.block_hashes).

A routing decision adds a provisional entry (the prompt's blocks on the chosen replica, for
`provisional_ttl_s` unless that replica's events confirm or drop them first), so a burst of
requests sharing a new prefix goes to one replica instead of each computing it somewhere else.

Not thread-safe: the gateway's event loop is its one user.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from inferplane.api.kv_blocks import Medium
from inferplane.v1 import worker_pb2

# What a block held in each medium is worth to a request, against computing it (1 would be free):
# the pool's blocks are used as they are, the memory tier's are copied in, the disk tier's read.
# A provisional entry counts as the pool: the replica is computing it now.
MEDIUM_WEIGHTS: dict[str, float] = {Medium.POOL: 1.0, Medium.MEMORY: 0.8, Medium.DISK: 0.5}
_BITS = {medium: 1 << i for i, medium in enumerate(MEDIUM_WEIGHTS)}
_WEIGHT_OF_MASK = [max((w for m, w in MEDIUM_WEIGHTS.items() if mask & _BITS[m]), default=0.0)
                   for mask in range(1 << len(_BITS))]

PROVISIONAL_TTL_S = 10.0


class KVIndex:
    def __init__(self, *, provisional_ttl_s: float = PROVISIONAL_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.provisional_ttl_s = provisional_ttl_s
        self._clock = clock
        self._blocks: dict[bytes, dict[str, int]] = {}  # block -> replica -> bit mask of media
        self._replicas: dict[str, dict[str, set[bytes]]] = {}  # replica -> medium -> blocks
        self._instances: dict[str, str] = {}  # replica -> the worker process its entries came from
        self._provisional: dict[bytes, dict[str, float]] = {}  # block -> replica -> expiry

    # -- events -------------------------------------------------------------------------------------

    def apply(self, address: str, batch: worker_pb2.KVEventBatch) -> None:
        """One batch of `address`'s stream. A snapshot, or a batch of another worker process at the
        same address, replaces what was known of it."""
        if batch.snapshot or self._instances.get(address, batch.instance_id) != batch.instance_id:
            self._forget(address)
        self._instances[address] = batch.instance_id
        self._replicas.setdefault(address, {})
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                self.stored(address, event.stored.medium, event.stored.block_hashes)
            elif kind == "removed":
                self.removed(address, event.removed.medium, event.removed.block_hashes)
            elif kind == "all_cleared":
                self.cleared(address, event.all_cleared.medium or None)

    def stored(self, address: str, medium: str, hashes: Iterable[bytes]) -> None:
        bit = _BITS.get(medium)
        if bit is None:
            return  # a medium this gateway does not know scores nothing
        held = self._replicas.setdefault(address, {}).setdefault(medium, set())
        for h in hashes:
            held.add(h)
            replicas = self._blocks.setdefault(h, {})
            replicas[address] = replicas.get(address, 0) | bit
            self._confirm(h, address)

    def removed(self, address: str, medium: str, hashes: Iterable[bytes]) -> None:
        bit = _BITS.get(medium)
        held = self._replicas.get(address, {}).get(medium)
        if bit is None or held is None:
            return
        for h in hashes:
            if h not in held:
                continue
            held.discard(h)
            self._unset(h, address, bit)
            self._confirm(h, address)

    def cleared(self, address: str, medium: str | None = None) -> None:
        media = self._replicas.get(address, {})
        for m in list(media) if medium is None else [medium]:
            for h in media.pop(m, ()):
                self._unset(h, address, _BITS[m])

    def _forget(self, address: str) -> None:
        """Forgets what `address`'s events said (this gateway's own provisional entries stay)."""
        self.cleared(address)
        self._replicas.pop(address, None)
        self._instances.pop(address, None)

    def drop(self, address: str) -> None:
        """Forgets `address` (its stream ended: the worker is gone, or will send a snapshot)."""
        self._forget(address)
        for h in [h for h, replicas in self._provisional.items() if address in replicas]:
            self._confirm(h, address)

    def _unset(self, h: bytes, address: str, bit: int) -> None:
        replicas = self._blocks.get(h)
        if replicas is None:
            return
        mask = replicas.get(address, 0) & ~bit
        if mask:
            replicas[address] = mask
        else:
            replicas.pop(address, None)
            if not replicas:
                del self._blocks[h]

    def _confirm(self, h: bytes, address: str) -> None:
        """The replica's own events now say where the block is: its provisional entry is done."""
        provisional = self._provisional.get(h)
        if provisional is not None and provisional.pop(address, None) is not None and not provisional:
            del self._provisional[h]

    # -- routing ------------------------------------------------------------------------------------

    def note_routed(self, address: str, hashes: Sequence[bytes]) -> None:
        """`address` was just given a prompt with these blocks: count them as held there for a while."""
        expiry = self._clock() + self.provisional_ttl_s
        for h in hashes:
            if not self._blocks.get(h, {}).get(address, 0) & _BITS[Medium.POOL]:
                self._provisional.setdefault(h, {})[address] = expiry

    def held_runs(self, hashes: Sequence[bytes], addresses: Iterable[str]) -> dict[str, float]:
        """Per replica, the run of `hashes` from the first that it holds, each block weighted by the
        best medium it is in (MEDIUM_WEIGHTS); replicas holding none are left out."""
        alive = set(addresses)
        scores = dict.fromkeys(alive, 0.0)
        now = self._clock()
        for h in hashes:
            held = self._blocks.get(h, {})
            provisional = self._provisional.get(h, {})
            for address in list(alive):
                weight = _WEIGHT_OF_MASK[held.get(address, 0)]
                if weight < 1.0 and provisional.get(address, 0.0) > now:
                    weight = MEDIUM_WEIGHTS[Medium.POOL]
                if weight == 0.0:
                    alive.discard(address)
                else:
                    scores[address] += weight
            if not alive:
                break
        return {address: score for address, score in scores.items() if score > 0}

    def confirmed_run(self, hashes: Sequence[bytes], address: str) -> int:
        """How many of `hashes`, in a row from the first, `address`'s own events say it holds (in any
        medium; this gateway's provisional entries do not count: they say where a prompt was sent,
        not what was computed)."""
        run = 0
        for h in hashes:
            if not self._blocks.get(h, {}).get(address, 0):
                break
            run += 1
        return run

    def expire(self) -> int:
        """Drops provisional entries past their time; returns how many."""
        now = self._clock()
        dropped = 0
        for h in list(self._provisional):
            replicas = self._provisional[h]
            for address in [a for a, expiry in replicas.items() if expiry <= now]:
                del replicas[address]
                dropped += 1
            if not replicas:
                del self._provisional[h]
        return dropped

    # -- introspection ------------------------------------------------------------------------------

    def blocks(self) -> int:
        """Distinct blocks some replica holds."""
        return len(self._blocks)

    def replica_blocks(self, address: str) -> dict[str, int]:
        """Blocks `address` holds, per medium."""
        return {medium: len(held) for medium, held in self._replicas.get(address, {}).items()}

    def replicas(self) -> list[str]:
        return sorted(self._replicas)
