"""The KV tiers keep blocks byte for byte, hand back nothing they cannot vouch for, and keep
tenants' blocks apart by name (inferplane/worker/engine/kv/tiers/)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

from inferplane.api.kv_blocks import chain_keys
from inferplane.worker.engine.kv.tiers.disk_tier import DiskTier
from inferplane.worker.engine.kv.tiers.layout import KVLayout
from inferplane.worker.engine.kv.tiers.memory_tier import MemoryTier
from inferplane.worker.engine.kv.tiers.record import HEADER, Miss, Part, decode, encode
from inferplane.worker.engine.kv.tiers.store import TieredKVStore, open_tiers, record_name
from inferplane.worker.ops.kv_cache import PagedKVCache

LAYOUT = KVLayout(model_digest="sha256:" + "ab" * 32, dtype="float16", block_size=4, layers=3, kv_heads=2,
                  head_dim=8, window_layers=1)


def filled_cache(seed: int = 0, blocks: int = 6) -> PagedKVCache:
    """A pool shaped as LAYOUT (layer 1 windowed) holding random KV in every block."""
    cache = PagedKVCache(num_layers=LAYOUT.layers + LAYOUT.window_layers, num_blocks=blocks,
                         block_size=LAYOUT.block_size, num_kv_heads=LAYOUT.kv_heads, head_dim=LAYOUT.head_dim,
                         dtype=torch.float16, device=torch.device("cpu"), window_layers=frozenset({1}),
                         num_window_blocks=blocks)
    gen = torch.Generator().manual_seed(seed)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen).half())
    cache.window_data.copy_(torch.randn(cache.window_data.shape, generator=gen).half())
    return cache


# --- names ------------------------------------------------------------------------------------------


def test_a_key_names_the_whole_prefix_and_its_namespace() -> None:
    tokens = list(range(100, 113))  # three full blocks of 4 and one token over
    keys = chain_keys("tenant-a", tokens, 4)
    assert len(keys) == 3 and len(set(keys)) == 3
    # The same prefix gives the same keys; a later token changes no earlier key.
    assert chain_keys("tenant-a", tokens[:8], 4) == keys[:2]
    # A change in block 0 changes every key after it: a key stands for everything before it.
    changed = chain_keys("tenant-a", [7, *tokens[1:]], 4)
    assert not set(changed) & set(keys)
    # Another namespace (tenant salt, adapter) never gets the same names for the same tokens.
    assert not set(chain_keys("tenant-b", tokens, 4)) & set(keys)
    assert not set(chain_keys("tenant-a\x00lora:x@1", tokens, 4)) & set(keys)
    # A chain continued from a key is the chain computed whole.
    assert chain_keys("tenant-a", tokens[4:], 4, parent=keys[0]) == keys[1:]


def test_a_layout_fingerprint_changes_with_every_field() -> None:
    changes = [{"model_digest": "sha256:" + "cd" * 32}, {"dtype": "bfloat16"}, {"block_size": 8}, {"layers": 4},
               {"kv_heads": 1}, {"head_dim": 16}, {"window_layers": 0}]
    prints = {LAYOUT.fingerprint()} | {replace(LAYOUT, **c).fingerprint() for c in changes}
    assert len(prints) == len(changes) + 1
    with pytest.raises(ValueError, match="dtype"):
        replace(LAYOUT, dtype="int3")


# --- records ----------------------------------------------------------------------------------------


def test_a_record_gives_its_payload_back_only_to_the_reader_it_was_written_for() -> None:
    cache = filled_cache()
    key, other_key = chain_keys("t", list(range(8)), 4)
    payload = cache.block_payload(2)
    assert len(payload) == LAYOUT.block_bytes()
    record = encode(LAYOUT, key, payload)
    assert decode(LAYOUT, key, record) == payload

    def reason(result) -> str:
        assert isinstance(result, Miss), "a bad record was accepted"
        return result.reason

    assert "checksum" in reason(decode(LAYOUT, key, record[:-1] + bytes([record[-1] ^ 1])))
    assert "truncated" in reason(decode(LAYOUT, key, record[:-3]))
    assert "truncated" in reason(decode(LAYOUT, key, record[:HEADER.size - 1]))
    assert "layout" in reason(decode(replace(LAYOUT, model_digest="sha256:" + "00" * 32), key, record))
    assert "layout" in reason(decode(replace(LAYOUT, head_dim=4, kv_heads=4), key, record))
    assert "key" in reason(decode(LAYOUT, other_key, record))
    assert "pool" in reason(decode(LAYOUT, key, record, Part.WINDOW))
    with pytest.raises(ValueError, match="payload"):
        encode(LAYOUT, key, payload[:-2])


def test_a_block_read_back_into_the_pool_is_the_block_that_left_it() -> None:
    source, target = filled_cache(seed=1), filled_cache(seed=2)
    key = chain_keys("t", list(range(4)), 4)[0]
    for window in (False, True):
        part = Part.WINDOW if window else Part.MAIN
        record = encode(LAYOUT, key, source.block_payload(3, window), part)
        target.load_block(5, decode(LAYOUT, key, record, part), window)
        data_s = source.window_data if window else source.data
        data_t = target.window_data if window else target.data
        assert torch.equal(data_t[:, :, 5], data_s[:, :, 3])
        assert not torch.equal(data_t[:, :, 4], data_s[:, :, 3])  # the other blocks are untouched
    with pytest.raises(ValueError, match="payload"):
        target.load_block(0, b"\x00" * 10)


# --- tiers ------------------------------------------------------------------------------------------


def test_the_memory_tier_evicts_least_recently_used_first_within_its_size() -> None:
    tier = MemoryTier(capacity=30)
    assert tier.put(b"a", b"x" * 10) == [] and tier.put(b"b", b"y" * 10) == [] and tier.put(b"c", b"z" * 10) == []
    assert tier.get(b"a") == b"x" * 10  # a is now the most recent
    assert tier.put(b"d", b"w" * 10) == [(b"b", b"y" * 10)]
    assert tier.keys() == [b"c", b"a", b"d"] and tier.used == 30
    assert tier.put(b"big", b"q" * 31) == [(b"big", b"q" * 31)] and b"big" not in tier
    assert tier.put(b"c", b"z" * 5) == [] and tier.used == 25  # a new record under a held name replaces it


def test_the_disk_tier_keeps_its_blocks_for_the_next_process_and_evicts_oldest_first(tmp_path) -> None:
    tier = DiskTier(tmp_path, capacity=30)
    for name in (b"a", b"b", b"c"):
        assert tier.put(name, name * 10) == []
    assert tier.get(b"a") == b"a" * 10
    assert tier.put(b"d", b"d" * 10) == [b"b"]
    assert len(list(tmp_path.glob("*/*.kvb"))) == 3
    # A leftover of an interrupted write is removed, never served; a fresh one (another writer's
    # write in progress, in a folder pods share) is left alone, and not served either.
    (tmp_path / "zz").mkdir()
    old, fresh = tmp_path / "zz" / "ff.kvb.123.tmp", tmp_path / "zz" / "ee.kvb.456.tmp"
    old.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    again = DiskTier(tmp_path, capacity=30)
    assert again.found == 3 and sorted(again.keys()) == [b"a", b"c", b"d"]
    assert again.get(b"c") == b"c" * 10
    assert not old.exists() and fresh.exists()
    # A smaller capacity at start evicts the least recently used of what it found.
    smaller = DiskTier(tmp_path, capacity=20)
    assert len(smaller) == 2 and b"c" in smaller


def test_the_store_spills_memory_to_disk_and_brings_disk_hits_back(tmp_path) -> None:
    cache = filled_cache()
    block = LAYOUT.block_bytes() + HEADER.size
    store = open_tiers(LAYOUT, memory_bytes=2 * block, disk_root=tmp_path, disk_bytes=10 * block)
    keys = chain_keys("tenant-a", list(range(16)), 4)
    for i, key in enumerate(keys):
        store.put(key, cache.block_payload(i))
    assert [store.where(k) for k in keys] == ["disk", "disk", "memory", "memory"]
    for i in (3, 2, 0, 1):  # byte-identical whichever tier it comes from
        assert store.get(keys[i]) == cache.block_payload(i)
    assert store.counters.hits == {"memory": 2, "disk": 2}
    # The disk hits came back to memory as the most recent; memory's oldest went to disk.
    assert [store.where(k) for k in keys] == ["memory", "memory", "disk", "disk"]
    # The other tenant's names for the same tokens find nothing.
    assert all(store.get(k) is None for k in chain_keys("tenant-b", list(range(16)), 4))
    stats = store.stats()
    assert stats["kv_tier_blocks:memory"] == 2 and stats["kv_tier_misses_total"] == 4


def test_a_damaged_or_foreign_block_on_disk_is_a_miss_and_is_removed(tmp_path) -> None:
    cache = filled_cache()
    keys = chain_keys("t", list(range(16)), 4)
    store = open_tiers(LAYOUT, disk_root=tmp_path, disk_bytes=1 << 20)
    for i, key in enumerate(keys):
        store.put(key, cache.block_payload(i))
    folder = tmp_path / LAYOUT.fingerprint().hex()
    paths = {key: folder / record_name(key, Part.MAIN).hex()[:2] / f"{record_name(key, Part.MAIN).hex()}.kvb"
             for key in keys}
    data = bytearray(paths[keys[0]].read_bytes())
    data[HEADER.size + 7] ^= 0x40  # one flipped bit in the KV
    paths[keys[0]].write_bytes(bytes(data))
    paths[keys[1]].write_bytes(paths[keys[1]].read_bytes()[:-100])  # truncated
    os.replace(paths[keys[2]], paths[keys[3]])  # block 2's record under block 3's name
    restarted = open_tiers(LAYOUT, disk_root=tmp_path, disk_bytes=1 << 20)
    assert [restarted.get(k) for k in keys] == [None] * 4
    assert dict(restarted.counters.rejected) == {"checksum": 1, "truncated or wrong length": 1,
                                                 "another block's key": 1}
    assert not any(p.exists() for p in paths.values())
    # A worker of another model or settings on the same root sees none of these blocks.
    other = open_tiers(replace(LAYOUT, block_size=8), disk_root=tmp_path, disk_bytes=1 << 20)
    assert other.disk is not None and len(other.disk) == 0


def test_a_store_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="tier"):
        TieredKVStore(LAYOUT)


@pytest.mark.parametrize("memory_blocks", [0, 8])
def test_a_prefetch_reads_the_disk_run_ahead_and_the_next_get_takes_it_from_memory(tmp_path, memory_blocks) -> None:
    cache = filled_cache()
    block = LAYOUT.block_bytes() + HEADER.size
    keys = chain_keys("t", list(range(24)), 4)
    writer = open_tiers(LAYOUT, disk_root=tmp_path, disk_bytes=1 << 20)
    for i, key in enumerate(keys[:5]):  # block 5 was never stored: the run ends before it
        writer.put(key, cache.block_payload(i))
    folder = tmp_path / LAYOUT.fingerprint().hex()
    name = record_name(keys[3], Part.MAIN).hex()
    damaged = folder / name[:2] / f"{name}.kvb"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")

    store = open_tiers(LAYOUT, memory_bytes=memory_blocks * block, disk_root=tmp_path, disk_bytes=1 << 20)
    assert store.prefetch(keys) == 3  # blocks 0-2; block 3 fails its check, which ends the run
    assert not damaged.exists() and store.counters.rejected["checksum"] == 1
    assert store.prefetch(keys) == 0  # already read ahead
    for i in range(3):
        assert store.get(keys[i]) == cache.block_payload(i)
    tier_hits = store.counters.hits
    assert tier_hits["disk"] == 0 and tier_hits["memory" if memory_blocks else "prefetched"] == 3
    assert store.get(keys[4]) == cache.block_payload(4) and tier_hits["disk"] == 1  # not read ahead: from disk


# --- the radix manager over the tiers, without a model -----------------------------------------------


def radix_with_tiers(window: int | None = None, blocks: int = 16):
    """A RadixKV over a real pool (layer 1 sliding when `window` is given) with a memory tier."""
    from inferplane.worker.engine.kv.radix import RadixKV
    from inferplane.worker.engine.kv.tiers.link import TierLink
    from inferplane.worker.engine.kv.window import WindowBlocks

    layout = LAYOUT if window else replace(LAYOUT, layers=LAYOUT.layers + 1, window_layers=0)
    cache = PagedKVCache(num_layers=4, num_blocks=blocks, block_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.float16, device=torch.device("cpu"),
                         window_layers=frozenset({1}) if window else frozenset(), num_window_blocks=blocks)
    link = TierLink(open_tiers(layout, memory_bytes=1 << 20), cache)
    windows = WindowBlocks(blocks, 4, window) if window else None
    return RadixKV(blocks, 4, windows, tiers=link), cache


def compute(kv, tokens: list[int], salt: str = "", cache: PagedKVCache | None = None):
    """Admits a sequence for `tokens` and 'computes' its prompt: each block it computes gets its
    position as its KV (main and window parts), so that what is read back can be told apart."""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.engine.sequence import Sequence

    seq = Sequence(request_id=f"r{len(tokens)}{salt}", prompt_token_ids=list(tokens), params=SamplingParams(),
                   max_tokens=4, rng_key=0, cache_salt=salt)
    kv.match_prefix(seq)
    computed = seq.num_computed_tokens // 4
    assert kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    if cache is not None:
        for i in range(computed, len(seq.block_table)):
            cache.data[:, :, seq.block_table[i]].fill_(i)
            if seq.window_table and seq.window_table[i]:
                cache.window_data[:, :, seq.window_table[i]].fill_(i)
    seq.num_computed_tokens = seq.num_tokens
    kv.on_computed(seq)
    return seq


def test_window_blocks_the_tree_dropped_from_a_prefix_it_holds_come_back_from_the_tiers() -> None:
    kv, cache = radix_with_tiers(window=8)
    tokens = list(range(50, 75))  # 6 full blocks and one token
    kv.free(compute(kv, tokens, cache=cache))
    assert kv.tree.evict_windows(100) > 0  # the tree keeps the main blocks, not one window block
    cache.window_data.zero_()
    again = compute(kv, tokens)
    assert again.num_cached_tokens == 24  # all six blocks: the last window's parts were read back
    for i in range(4, 6):  # the window of 8 tokens at position 24 spans blocks 4 and 5
        assert torch.all(cache.window_data[:, :, again.window_table[i]] == i)
    assert kv.tiers.loaded_blocks == 0  # no main block needed reading


def test_a_load_that_raises_gives_its_blocks_back() -> None:
    kv, _ = radix_with_tiers()
    tokens = list(range(20, 41))  # 5 full blocks and one token
    kv.free(compute(kv, tokens, salt="a"))
    assert kv.tree.evict(100) == 5 and kv.pool.num_free == 16
    kv.tiers.load = lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("device lost"))
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.engine.sequence import Sequence

    seq = Sequence(request_id="x", prompt_token_ids=tokens, params=SamplingParams(), max_tokens=4,
                   rng_key=0, cache_salt="a")
    with pytest.raises(RuntimeError, match="device lost"):
        kv.match_prefix(seq)
    assert kv.pool.num_free == 16 and kv.tree.num_blocks == 0


def test_two_writers_sharing_a_folder_see_each_others_blocks_and_a_miss_for_what_the_other_evicted(tmp_path) -> None:
    """A rollout's new pod beside the old one on a node's folder (operator/kv_tier.py)."""
    old = DiskTier(tmp_path, capacity=30)
    old.put(b"a", b"a" * 10)
    new = DiskTier(tmp_path, capacity=20)
    assert new.found == 1 and new.get(b"a") == b"a" * 10
    old.put(b"b", b"b" * 10)  # written after the new one listed the folder: the new one does not know it
    new.put(b"c", b"c" * 10)
    new.put(b"d", b"d" * 10)  # the new one's room is full: it evicts its oldest, a
    assert b"a" not in new and old.get(b"a") is None and b"a" not in old  # a miss for the old one, never bytes
    assert old.get(b"b") == b"b" * 10 and new.get(b"c") == b"c" * 10
