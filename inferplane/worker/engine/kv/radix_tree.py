"""A radix tree over token blocks: the prefix cache of the radix runtime.

Edges are labelled with whole blocks of tokens (one tuple of `block_size` ids per block) and carry
the pool block that holds each block's KV. Keys are block-aligned on purpose: a block is shared only
once all of its slots are written, so no reader ever sees a half-written block and no writer ever
writes into a block someone else reads.

The tree holds one pool reference on every block it stores. A node's `lock_ref` counts the running
sequences whose path passes through it; locked nodes are never evicted. Because every sequence
that locks a node also holds its own reference on that node's blocks, an unlocked node's blocks are
held by the tree alone: `evictable_blocks` is both what eviction can free and what the runtime
reports as cached.

Each namespace (cache salt) has its own root, so two tenants never reach each other's blocks, and
one LRU order spans them all, since they share one pool.

Models with sliding-window layers (kv/window.py) have a second pool: beside each block a node keeps
that block's window-pool block, or NULL_BLOCK where none is kept. The tree holds one reference on
each it keeps; a window block only the tree holds is cache like any unlocked block, and
`evict_windows` frees those (least recently used nodes first) even on locked paths, since no running
sequence reads it. A prefix is usable only where its last window's blocks are all kept (the radix
manager cuts matches there).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

from inferplane.api.kv_blocks import LORA_MARK, Medium
from inferplane.worker.engine.kv.block_pool import BlockPool
from inferplane.worker.engine.kv.events import KVEventLog
from inferplane.worker.engine.kv.window import NULL_BLOCK

BlockKey = tuple[int, ...]


def block_keys(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[BlockKey]:
    return [tuple(tokens[i * block_size:(i + 1) * block_size]) for i in range(num_blocks)]


class Node:
    __slots__ = ("keys", "blocks", "windows", "hashes", "children", "parent", "lock_ref", "last_access", "depth")

    def __init__(self, keys: list[BlockKey], blocks: list[int], parent: Node | None, depth: int,
                 windows: list[int] | None = None, hashes: list[bytes] | None = None):
        self.keys = keys
        self.blocks = blocks
        # Each block's name (api/kv_blocks.py) where the tree publishes events, else empty.
        self.hashes = hashes if hashes is not None else []
        self.windows = windows if windows is not None else [NULL_BLOCK] * len(blocks)  # window-pool block per block
        self.children: dict[BlockKey, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        # Blocks from the root to the end of this node. A split keeps the original object as the
        # lower half, so a sequence holding its deepest node keeps a valid depth.
        self.depth = depth

    @property
    def is_root(self) -> bool:
        return self.parent is None


def _common(keys: list[BlockKey], query: Sequence[BlockKey], start: int) -> int:
    n = 0
    while n < len(keys) and start + n < len(query) and keys[n] == query[start + n]:
        n += 1
    return n


class RadixTree:
    def __init__(self, pool: BlockPool, window_pool: BlockPool | None = None, events: KVEventLog | None = None):
        """With `events`, every block that joins or leaves the tree is published (kv/events.py); each
        insert must then name its blocks (`hashes`)."""
        self.pool = pool
        self.events = events
        self.window_pool = window_pool
        self.roots: dict[str, Node] = {}
        self.num_nodes = 0  # roots excluded
        self.num_blocks = 0  # blocks the tree holds a reference on
        self.evictable_blocks = 0  # blocks in unlocked nodes: held by the tree alone
        self.evicted_blocks = 0
        self.evicted_window_blocks = 0  # cached window blocks freed for the sliding layers' pool
        self._clock = itertools.count(1)  # logical LRU time: deterministic, never ties on one path

    # -- lookups ----------------------------------------------------------------------------------

    def peek(self, namespace: str, keys: Sequence[BlockKey]) -> int:
        """Blocks of `keys` the tree holds, changing nothing (for the scheduler's ordering)."""
        node = self.roots.get(namespace)
        matched = 0
        while node is not None and matched < len(keys):
            child = node.children.get(keys[matched])
            if child is None:
                break
            k = _common(child.keys, keys, matched)
            matched += k
            if k < len(child.keys):
                break
            node = child
        return matched

    def match(self, namespace: str, keys: Sequence[BlockKey]) -> tuple[Node | None, list[int], list[int]]:
        """The longest cached prefix of `keys`: its deepest node, its blocks and their window blocks.
        A node matched part way is split so that the match ends on a node boundary and can be locked
        exactly."""
        node = self.roots.get(namespace)
        if node is None:
            return None, [], []
        now = next(self._clock)
        blocks: list[int] = []
        windows: list[int] = []
        while len(blocks) < len(keys):
            child = node.children.get(keys[len(blocks)])
            if child is None:
                break
            k = _common(child.keys, keys, len(blocks))
            if k < len(child.keys):
                child = self._split(child, k)
            child.last_access = now
            blocks.extend(child.blocks)
            windows.extend(child.windows)
            node = child
        return node, blocks, windows

    # -- updates ----------------------------------------------------------------------------------

    def insert(self, namespace: str, start: Node | None, keys: Sequence[BlockKey], blocks: Sequence[int],
               windows: Sequence[int] | None = None,
               hashes: Sequence[bytes] | None = None) -> tuple[Node, list[int], list[int]]:
        """Adds `keys[start.depth:]` below `start` (the root when None), adopting the caller's blocks
        (and window blocks) where the tree has none. Returns the deepest node and, per inserted key,
        the block and the window block the tree now holds for it: where those differ from the
        caller's, the caller should switch to them. `hashes` names each key's block (as `keys`,
        from the root), required where the tree publishes events."""
        if self.events is not None and (hashes is None or len(hashes) < len(keys)):
            raise ValueError("a tree that publishes KV events needs every inserted block's name")
        node = start if start is not None else self.roots.setdefault(namespace, Node([], [], None, 0))
        windows = windows if windows is not None else [NULL_BLOCK] * len(keys)
        now = next(self._clock)
        i = node.depth
        held: list[int] = []
        held_windows: list[int] = []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                child = Node(list(keys[i:]), list(blocks[i:]), node, len(keys), list(windows[i:]),
                             list(hashes[i:len(keys)]) if hashes is not None else None)
                for block in child.blocks:
                    self.pool.retain(block)
                for block in child.windows:
                    if block != NULL_BLOCK:
                        self.window_pool.retain(block)
                node.children[child.keys[0]] = child
                self.num_nodes += 1
                self.num_blocks += len(child.blocks)
                self.evictable_blocks += len(child.blocks)
                child.last_access = now
                held.extend(child.blocks)
                held_windows.extend(child.windows)
                if self.events is not None:
                    self.events.stored(Medium.POOL, child.hashes, parent=node.hashes[-1] if node.hashes else None,
                                       token_ids=[t for key in child.keys for t in key],
                                       lora_name=namespace.partition(LORA_MARK)[2])
                return child, held, held_windows
            k = _common(child.keys, keys, i)
            if k < len(child.keys):
                child = self._split(child, k)
            child.last_access = now
            for j in range(k):  # keep a window block the tree lacks
                if child.windows[j] == NULL_BLOCK and windows[i + j] != NULL_BLOCK:
                    self.window_pool.retain(windows[i + j])
                    child.windows[j] = windows[i + j]
            held.extend(child.blocks)
            held_windows.extend(child.windows)
            node = child
            i += k
        return node, held, held_windows

    def _split(self, node: Node, k: int) -> Node:
        """Cuts `node` after its first k blocks; the new upper node inherits its lock and age."""
        upper = Node(node.keys[:k], node.blocks[:k], node.parent, node.depth - len(node.keys) + k, node.windows[:k],
                     node.hashes[:k])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children = {node.keys[k]: node}
        node.parent.children[upper.keys[0]] = upper
        node.keys = node.keys[k:]
        node.blocks = node.blocks[k:]
        node.windows = node.windows[k:]
        node.hashes = node.hashes[k:]
        node.parent = upper
        self.num_nodes += 1
        return upper

    def lock(self, node: Node | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise AssertionError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
            node = node.parent

    def evict(self, count: int) -> int:
        """Frees up to `count` blocks from unlocked leaves, least recently used first, trimming a
        leaf from its tail so that no more is dropped than asked for. Returns the blocks freed."""
        order = itertools.count()  # tie-break: nodes are not comparable
        heap = [(n.last_access, next(order), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < count and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.blocks), count - freed)
            first_key = leaf.keys[0]
            for block in leaf.blocks[len(leaf.blocks) - take:]:
                if not self.pool.release(block):
                    raise AssertionError(f"evicted block {block} is still referenced")
            for block in leaf.windows[len(leaf.windows) - take:]:
                if block != NULL_BLOCK:
                    self.window_pool.release(block)
            del leaf.blocks[len(leaf.blocks) - take:]
            del leaf.windows[len(leaf.windows) - take:]
            del leaf.keys[len(leaf.keys) - take:]
            if self.events is not None:
                self.events.removed(Medium.POOL, leaf.hashes[len(leaf.hashes) - take:])
            del leaf.hashes[len(leaf.hashes) - take:]
            leaf.depth -= take
            freed += take
            if leaf.blocks:
                continue
            parent = leaf.parent
            del parent.children[first_key]
            self.num_nodes -= 1
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        self.num_blocks -= freed
        self.evictable_blocks -= freed
        self.evicted_blocks += freed
        self.roots = {ns: root for ns, root in self.roots.items() if root.children}
        return freed

    def _tree_only_windows(self) -> list[tuple[int, Node, int]]:
        """(last access, node, index) of each window block only the tree references."""
        refs = self.window_pool.ref_counts
        return [(n.last_access, n, i) for n in self.nodes() for i, b in enumerate(n.windows)
                if b != NULL_BLOCK and refs[b] == 1]

    def evictable_windows(self) -> int:
        return len(self._tree_only_windows()) if self.window_pool is not None else 0

    def evict_windows(self, count: int) -> int:
        """Frees up to `count` window blocks only the tree holds, least recently used nodes first
        (and, within a node, the oldest positions first: the last window is what a match needs)."""
        if self.window_pool is None:
            return 0
        candidates = sorted(self._tree_only_windows(), key=lambda c: (c[0], c[2]))
        for _, node, i in candidates[:count]:
            self.window_pool.release(node.windows[i])
            node.windows[i] = NULL_BLOCK
        freed = min(count, len(candidates))
        self.evicted_window_blocks += freed
        return freed

    # -- introspection ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        """Every node but the roots, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
