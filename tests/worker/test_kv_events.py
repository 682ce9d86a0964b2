"""KV events: the worker publishes which blocks it holds, in its pool and each tier, under the names the
gateway computes for the same prompt; a snapshot always equals what the events add up to."""

from __future__ import annotations

from array import array

import pytest

from inferplane.api.kv_blocks import Medium, adapter_cache_key
from inferplane.control_plane.routing.prefix import block_hashes
from inferplane.worker.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from inferplane.worker.engine.kv.radix import RadixKV
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.llm import LLM
from inferplane.worker.serve.kv_event_stream import snapshot_batches

from .conftest import prompts_of_lengths
from .test_radix_kv import make_seq, run_to_end

BS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def replay(events) -> dict[Medium, set[bytes]]:
    """What a subscriber knows after `events`, applied in order."""
    held: dict[Medium, set[bytes]] = {m: set() for m in Medium}
    for event in events:
        if isinstance(event, BlockStored):
            held[event.medium] |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held[event.medium] -= set(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            for m in Medium if event.medium is None else (event.medium,):
                held[m].clear()
    return held


def all_events(log: KVEventLog):
    position, events = log.since(0)
    return events


# -- the log ---------------------------------------------------------------------------------------

def test_the_log_publishes_changes_only_and_its_snapshot_is_their_sum() -> None:
    log = KVEventLog(block_size=BS)
    log.stored(Medium.POOL, [b"a", b"b"], parent=b"p", token_ids=range(8))
    log.stored(Medium.POOL, [b"b", b"c"])  # b is held already: only c is news
    log.removed(Medium.POOL, [b"a", b"x"])  # x was never held: only a goes
    log.set_held(Medium.DISK, b"c", True)
    log.set_held(Medium.DISK, b"c", True)
    events = all_events(log)
    assert events == [BlockStored((b"a", b"b"), Medium.POOL, b"p", array("I", range(8))),
                      BlockStored((b"c",), Medium.POOL), BlockRemoved((b"a",), Medium.POOL),
                      BlockStored((b"c",), Medium.DISK)]
    position, held = log.snapshot()
    assert position == 4 and {m: set(h) for m, h in held.items()} == replay(events)
    assert log.since(position) == (position, [])
    log.cleared(Medium.POOL)
    assert log.snapshot()[1][Medium.POOL] == [] and log.snapshot()[1][Medium.DISK] == [b"c"]


def test_a_subscriber_further_behind_than_the_log_keeps_is_told_to_take_a_snapshot() -> None:
    log = KVEventLog(block_size=BS, capacity=3)
    for i in range(5):
        log.stored(Medium.POOL, [bytes([i])])
    assert log.since(0) is None and log.since(1) is None
    assert log.since(2) == (5, [BlockStored((bytes([i]),), Medium.POOL) for i in (2, 3, 4)])


# -- the engine ------------------------------------------------------------------------------------

def test_the_pool_publishes_what_the_tree_holds_under_the_gateways_names(tiny_llama) -> None:
    llm = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=24, max_num_seqs=2)
    log = llm.engine.kv.events
    assert log is not None  # on by default with the radix KV manager
    conversation, *others = prompts_of_lengths([41, 40, 40], 320, seed=7)
    llm.generate(conversation, GREEDY, cache_salt="tenant-a")
    held = replay(all_events(log))[Medium.POOL]
    # The gateway names the prompt's blocks (every full block before the last token) alike.
    names = block_hashes(conversation[:-1], BS, "tenant-a")
    assert len(names) == 10 and set(names) <= held
    assert not set(block_hashes(conversation[:-1], BS, "tenant-b")) & held  # another tenant's names differ
    llm.generate(others, GREEDY, cache_salt="tenant-a")  # pushes the conversation's blocks out of the pool
    assert llm.stats()["evicted_blocks"] > 0
    events = all_events(log)
    held = replay(events)[Medium.POOL]
    assert not set(names) <= held and any(isinstance(e, BlockRemoved) for e in events)
    # What the events add up to is what the tree holds, and what a snapshot says.
    tree = {h for node in llm.engine.kv.tree.nodes() for h in node.hashes}
    assert held == tree and set(log.snapshot()[1][Medium.POOL]) == tree
    assert llm.stats()["kv_events_published_total"] == len(events)


def test_an_adapters_blocks_are_named_with_the_adapter() -> None:
    kv = RadixKV(64, BS, events=KVEventLog(BS))

    class Adapter:
        key = adapter_cache_key("support-bot", "ab" * 32)

    seq = make_seq(list(range(1, 18)), salt="s")
    seq.adapter = Adapter()
    run_to_end(kv, seq)
    (event,) = [e for e in all_events(kv.events) if isinstance(e, BlockStored)]
    assert list(event.block_hashes) == block_hashes(list(range(1, 17)), BS, "s", adapter_key=Adapter.key)
    assert event.lora_name == Adapter.key and list(event.token_ids) == list(range(1, 17))
    assert event.parent_block_hash is None  # the first block of its namespace


def test_tiers_publish_memory_and_disk_and_a_later_worker_announces_the_disk(tiny_llama, tmp_path) -> None:
    tiers = {"kv_offload_memory": "64MiB", "kv_offload_disk": "64MiB", "kv_offload_dir": str(tmp_path)}
    prompt = prompts_of_lengths([33], 320, seed=8)[0]
    names = set(block_hashes(prompt[:-1], BS, "t"))
    earlier = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **tiers)
    earlier.generate(prompt, GREEDY, cache_salt="t")
    held = replay(all_events(earlier.engine.kv.events))
    assert names <= held[Medium.POOL] and names <= held[Medium.MEMORY] and names <= held[Medium.DISK]
    del earlier

    later = LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=64, **tiers)
    position, batches = snapshot_batches(later.engine.kv.events)
    assert batches[0].snapshot and batches[0].events[0].WhichOneof("event") == "all_cleared"
    announced = {h for b in batches for e in b.events if e.WhichOneof("event") == "stored"
                 and e.stored.medium == "disk" for h in e.stored.block_hashes}
    assert names <= announced  # the disk tier it found, announced as its own
    assert not replay(all_events(later.engine.kv.events))[Medium.POOL]


def test_events_can_be_turned_off_and_paged_refuses_them(tiny_llama) -> None:
    assert LLM(tiny_llama, runtime="radix", block_size=BS, num_kv_blocks=16, kv_events=False).engine.kv.events is None
    assert LLM(tiny_llama, runtime="paged", block_size=BS, num_kv_blocks=16).engine.kv.events is None
    with pytest.raises(ValueError, match="kv_events"):
        LLM(tiny_llama, runtime="paged", block_size=BS, num_kv_blocks=16, kv_events=True)
