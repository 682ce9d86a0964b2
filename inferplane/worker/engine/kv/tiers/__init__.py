"""KV tiers: where a block's KV goes when it leaves the worker's pool, so that a conversation
returning after eviction, a move to another replica or a restart reads its KV back instead of
recomputing it.

- A block's name is `api/kv_blocks.py`'s chained hash of its namespace (tenant salt, adapter) and
  every token up to its end, so two tenants' blocks never share a name (the gateway names them alike).
- `layout.py`: what a block's bytes mean (model digest, KV dtype, block size, layer layout); a block
  written under another layout is never read.
- `record.py`: a block as stored: a fixed header (layout fingerprint, key, length, checksum) and the
  payload. Any mismatch on read is a miss, never wrong KV.
- `memory_tier.py`, `disk_tier.py`: host memory and a directory, each least recently used first
  within its size; the disk tier finds the blocks a previous process left.
- `store.py`: the two in order: memory's evictions spill to disk, disk hits come back to memory.
"""
