"""The fixed pool of KV blocks shared by all KV-cache groups.

Owner of: every block's ref count and hash, the free queue, and the prefix-cache
map `(group, hash) → block`. Nothing else mutates these.

    ref_cnt > 0            in use by that many requests
    ref_cnt == 0, hashed   free but still cached: a later request may revive it
    ref_cnt == 0, no hash  free

The free queue is LRU: blocks are taken from its head (evicting their cached hash)
and freed blocks join its tail. Block 0 is the *null block*: never allocated,
it fills block-table entries a sliding-window layer no longer needs.

With KV cache events on (`events` a list, kv_cache/events.py) every eviction and reset is
recorded there in order; `KVCacheManager.cache_blocks` records the blocks entering.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvrelay.kv_cache.events import CacheEvent, Cleared, Removed
from kvrelay.kv_cache.hashing import BlockHash

NULL_BLOCK = 0


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group: int = -1            # the KV-cache group whose cache holds this block's hash


class OutOfBlocks(Exception):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the null block), got "
                             f"{num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[tuple[int, BlockHash], KVBlock] = {}
        self.blocks[NULL_BLOCK].ref_cnt = 1   # permanently held
        self.events: list[CacheEvent] | None = None   # KV cache events: a list when on

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used / (self.num_blocks - 1)

    def lookup(self, group: int, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get((group, block_hash))

    # -- mutations ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks (ref_cnt 1) from the LRU head, evicting their cached hashes."""
        if n > len(self.free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); revives free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail.
        Pass a request's blocks tail-first so its last blocks are evicted first."""
        for block in blocks:
            if block.block_id == NULL_BLOCK:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(
                    f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = None

    def cache(self, block: KVBlock, group: int, block_hash: BlockHash) -> bool:
        """Record that `block` holds the tokens named by `block_hash` (first writer wins);
        whether it entered the cache."""
        if block.block_hash is not None or (group, block_hash) in self.cached:
            return False
        block.block_hash, block.group = block_hash, group
        self.cached[(group, block_hash)] = block
        return True

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get((block.group, block.block_hash)) is block:
                del self.cached[(block.group, block.block_hash)]
                if self.events is not None:
                    self.events.append(Removed(block.group, block.block_hash))
            block.block_hash, block.group = None, -1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache); refused (False) while any
        block is in use, as a running request's blocks would stay cached under it."""
        if self.num_used:
            return False
        for block in self.cached.values():
            block.block_hash, block.group = None, -1
        self.cached.clear()
        if self.events is not None:
            self.events.append(Cleared())
        return True

    def check_integrity(self) -> None:
        """free + used == total; ref counts ≥ 0; free ⇔ ref_cnt 0; cache map consistent."""
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in self.free):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                                     f"{'in' if block.block_id in self.free else 'not in'} free "
                                     "queue")
        if NULL_BLOCK in self.free:
            raise AssertionError("the null block is in the free queue")
        for (group, block_hash), block in self.cached.items():
            if block.block_hash != block_hash or block.group != group:
                raise AssertionError(f"cache map entry for block {block.block_id} is stale")
        if self.num_free + self.num_used != self.num_blocks - 1:
            raise AssertionError("free + used != total")
