"""Consistent-hash ring with virtual nodes and the bounded-load walk.

Virtual nodes smooth the share of the key space each replica owns; adding or removing a replica then
moves only the keys of that replica (about 1/N). The bounded-load rule (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads") keeps prefix affinity from piling a hot prefix onto one pod:
a replica whose load would exceed ceil((1 + epsilon) * average) is skipped and the walk goes on
clockwise, so a hot key overflows to the same *next* replicas every time and still finds warm caches.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping


def _point(member: str, replica: int) -> int:
    digest = hashlib.blake2b(f"{member}#{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class HashRing:
    """Immutable ring; rebuild it when the member set changes (cheap: members * vnodes hashes)."""

    def __init__(self, members: Iterable[str], vnodes: int = 160) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be positive")
        self.members: frozenset[str] = frozenset(members)
        pairs = sorted((_point(m, i), m) for m in self.members for i in range(vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [m for _, m in pairs]

    def walk(self, key: int) -> Iterator[str]:
        """Distinct members clockwise from ``key``: the owner first, then its successors."""
        if not self._points:
            return
        start = bisect.bisect_right(self._points, key)
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            member = self._owners[(start + i) % n]
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == len(self.members):
                    return

    def owner(self, key: int) -> str | None:
        return next(self.walk(key), None)


def load_bound(total_load: int, n_members: int, epsilon: float) -> int:
    """Most requests one member may hold once the incoming one is placed.

    The incoming request is counted in the average, as in the paper, so the bound is never zero and
    the members' bounds always sum to more than the total: the walk is guaranteed to find room.
    """
    if n_members <= 0:
        raise ValueError("no members")
    return math.ceil((1.0 + epsilon) * (total_load + 1) / n_members)


def bounded_pick(ring: HashRing, key: int, candidates: Mapping[str, int], epsilon: float) -> str | None:
    """First member clockwise from ``key`` that is a candidate and under the bound.

    ``candidates`` maps each eligible member to its current load; members of the ring that are not
    in it (unhealthy, already tried) are stepped over, which is the same as removing them from the
    ring, so their keys go to their successors and nobody else's keys move.
    """
    if not candidates:
        return None
    cap = load_bound(sum(candidates.values()), len(candidates), epsilon)
    for member in ring.walk(key):
        load = candidates.get(member)
        if load is not None and load + 1 <= cap:
            return member
    return None
