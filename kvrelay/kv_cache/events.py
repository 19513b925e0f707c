"""What the prefix cache records for KV cache events (`--kv-events-config`), torch-free.

`BlockPool` and `KVCacheManager` append these to `BlockPool.events` (a list, or None when
events are off: then nothing is recorded) in the order the cache changed:

    Stored    full blocks entered the prefix cache (one contiguous run of one request's
              table in one group: `hashes[i]` names `token_ids[i*B:(i+1)*B]`, `parent`
              the block before the run, None at block 0)
    Removed   a cached block was evicted (its hash left the cache map)
    Cleared   the whole prefix cache was reset

The engine takes them once per step (`KVCacheManager.take_events`) and hands them to the
publisher (`kvrelay/kv_events/`), which turns them into vLLM's wire events off the step
loop. Hashes stay kvrelay's 32-byte SHA-256 here; the publisher decides what goes on the
wire.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrelay.kv_cache.hashing import BlockHash


@dataclass(slots=True)
class Stored:
    group: int
    hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]


@dataclass(slots=True)
class Removed:
    group: int
    block_hash: BlockHash


@dataclass(slots=True)
class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared
