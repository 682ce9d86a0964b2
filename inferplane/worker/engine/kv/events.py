"""KV events: which blocks this worker holds and where, published as vLLM publishes its KV cache.

vLLM's KV events (BlockStored with the blocks' hashes, their parent's hash, the token ids, the block
size, the adapter and the medium; BlockRemoved with the hashes and the medium; AllBlocksCleared)
are what llm-d's and Dynamo's routers read to score replicas by the blocks they hold. The radix
tree reports what joins and leaves the pool, the tiers what joins and leaves host memory and disk
(`Medium`), and the gRPC server streams them to every gateway that subscribes (serve/server.py's
`KVEvents`), each stream starting with a snapshot: a gateway that (re)connects learns the whole
state at once instead of replaying a history it missed.

Block hashes are `api/kv_blocks.py`'s names (namespace: the tenant's cache salt and the adapter),
so the gateway computes a prompt's names itself and no tokens cross the wire twice.

Thread-safe: the engine thread (the tree, the tiers' writes) and the prepare pool (read-ahead into
memory) both publish; the log keeps what each medium holds, so a block reported twice is
published once and a snapshot is always what the events so far add up to.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inferplane.api.kv_blocks import Medium


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    medium: Medium
    parent_block_hash: bytes | None = None  # the block before the first, where it is known
    # The blocks' tokens where the publisher has them (the pool), 4 bytes each: a log of long
    # prompts' events stays a few MiB.
    token_ids: array = field(default_factory=lambda: array("I"))
    lora_name: str = ""  # the adapter's key (name@digest start), "" for the base


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: Medium


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: Medium | None = None  # None: every medium


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# Events kept for subscribers that fall behind; one further behind gets a fresh snapshot instead.
DEFAULT_CAPACITY = 4096


class KVEventLog:
    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY):
        self.block_size = block_size
        self._lock = threading.Lock()
        self._held: dict[Medium, dict[bytes, None]] = {medium: {} for medium in Medium}
        self._events: deque[tuple[int, KVEvent]] = deque(maxlen=capacity)
        self._position = 0  # events published so far: a subscriber's place in the stream
        self._listeners: list[Callable[[], None]] = []
        self.published = 0  # events, for the worker's stats

    # -- publishing ---------------------------------------------------------------------------------

    def stored(self, medium: Medium, hashes: Iterable[bytes], *, parent: bytes | None = None,
               token_ids: Iterable[int] = (), lora_name: str = "") -> None:
        """Blocks now held in `medium` (those it held already are left out of the event)."""
        hashes = tuple(hashes)
        with self._lock:
            held = self._held[medium]
            new = tuple(h for h in hashes if h not in held)
            if not new:
                return
            for h in new:
                held[h] = None
            # Tokens and parent describe the whole run: kept only when every block of it is new.
            whole = len(new) == len(hashes)
            self._append(BlockStored(new, medium, parent if whole else None,
                                     array("I", token_ids if whole else ()), lora_name))

    def removed(self, medium: Medium, hashes: Iterable[bytes]) -> None:
        """Blocks `medium` no longer holds (those it did not hold are left out)."""
        with self._lock:
            held = self._held[medium]
            gone = tuple(h for h in hashes if held.pop(h, False) is None)
            if gone:
                self._append(BlockRemoved(gone, medium))

    def set_held(self, medium: Medium, block_hash: bytes, held: bool) -> None:
        """One block's state in `medium`, published only where it changed."""
        if held:
            self.stored(medium, (block_hash,))
        else:
            self.removed(medium, (block_hash,))

    def cleared(self, medium: Medium | None = None) -> None:
        with self._lock:
            for m in Medium if medium is None else (medium,):
                self._held[m].clear()
            self._append(AllBlocksCleared(medium))

    def _append(self, event: KVEvent) -> None:
        self._position += 1
        self.published += 1
        self._events.append((self._position, event))
        for listener in self._listeners:
            listener()

    # -- subscribing --------------------------------------------------------------------------------

    def snapshot(self) -> tuple[int, dict[Medium, list[bytes]]]:
        """(position, what each medium holds): the state the events up to `position` add up to."""
        with self._lock:
            return self._position, {medium: list(held) for medium, held in self._held.items()}

    def since(self, position: int) -> tuple[int, list[KVEvent]] | None:
        """The events after `position` and the new position; None where some of them are no longer
        kept (the subscriber fell more than `capacity` events behind: it needs a snapshot)."""
        with self._lock:
            if position == self._position:
                return position, []
            if not self._events or self._events[0][0] > position + 1:
                return None
            skip = position + 1 - self._events[0][0]
            events = [event for _, event in itertools.islice(self._events, skip, None)]
            return self._position, events

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener` is called (on the publishing thread, under the log's lock: it must only wake
        something up) after each event."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
