"""Per-request KV block tables over KV-cache groups, with prefix caching.

Owner of: each request's block table per group and how many of its blocks are
registered in the prefix cache. The `BlockPool` owns the blocks themselves.

Groups (the hybrid KV cache manager): group 0 holds the full-attention layers,
group 1 the sliding-window layers. Each group keeps its own table for a request;
both take blocks from the same pool. A sliding-window table replaces blocks that
left the window with the null block:

    window W=8, block B=4, 14 tokens computed; next query position 14 sees keys 7..14
      positions:  0-3  4-7  8-11 12-15
      table:     [null, b4,  b9,  b2 ]     block 0 released (all of it < 14-8+1 = 7)

Prefix hits (never covering the last prompt token, so there is always a token to
compute and logits to sample from):
  full attention   the longest run of cached blocks from block 0;
  sliding window   the longest L such that the blocks holding positions
                   [L·B - W + 1, L·B) are cached (earlier ones may be gone);
  hybrid           L_full, then the sliding rule below L_full, then full truncated.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from kvrelay.kv_cache.block_pool import NULL_BLOCK, BlockPool, KVBlock
from kvrelay.kv_cache.events import CacheEvent, Stored
from kvrelay.kv_cache.hashing import BlockHash, hash_block, root_hash


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None          # None: full attention
    num_layers: int


@dataclass
class PrefixHit:
    num_tokens: int
    blocks: list[list[KVBlock]]  # per group, aligned with the table (null where skipped)


@dataclass
class _RequestState:
    tables: list[list[KVBlock]]
    num_cached: list[int]
    hashes: list[BlockHash] = field(default_factory=list)
    # `allocate` is a no-op while num_tokens <= fits_tokens and num_computed <=
    # fits_computed: the tables already cover those tokens and no sliding-window block
    # leaves the window (set after each full allocation; a decode crosses a block
    # boundary once in block_size steps)
    fits_tokens: int = 0
    fits_computed: int = -1
    # `block_ids`' answer, built once per change of the tables (every running request is
    # asked every step; its tables change once in block_size decode steps). Never mutated:
    # a change builds new lists, so an earlier answer a caller kept stays as it was.
    ids: list[list[int]] | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0             # prompt tokens looked up
    hits: int = 0                # of which found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVCacheGroup],
                 enable_prefix_caching: bool = True, hash_seed: str = "",
                 enable_kv_cache_events: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.groups = list(groups)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        if enable_kv_cache_events:           # the prefix cache's changes, for --kv-events-config
            self.pool.events = []
        self.root = root_hash(hash_seed)
        self.requests: dict[str, _RequestState] = {}
        self.stats = PrefixCacheStats()

    # -- queries ------------------------------------------------------------------------
    def block_ids(self, req_id: str) -> list[list[int]]:
        """The request's block ids per group (shared lists: read them, do not modify)."""
        state = self.requests[req_id]
        if state.ids is None:
            state.ids = [[b.block_id for b in table] for table in state.tables]
        return state.ids

    def num_blocks_held(self, req_id: str) -> int:
        return sum(b.block_id != NULL_BLOCK for t in self.requests[req_id].tables for b in t)

    def _hashes(self, state: _RequestState, tokens: Sequence[int],
                num_full: int) -> list[BlockHash]:
        B = self.block_size
        while len(state.hashes) < num_full:
            i = len(state.hashes)
            parent = state.hashes[-1] if state.hashes else self.root
            state.hashes.append(hash_block(parent, tokens[i * B:(i + 1) * B]))
        return state.hashes[:num_full]

    # -- prefix hits --------------------------------------------------------------------
    def find_prefix_hit(self, req_id: str, prompt: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of `prompt` usable by every group (whole blocks,
        at most len(prompt) - 1 tokens). Takes no references; `allocate` does."""
        empty = PrefixHit(0, [[] for _ in self.groups])
        if not self.enable_prefix_caching:
            return empty
        self.stats.queries += len(prompt)
        state = self.requests.setdefault(req_id, self._new_state())
        hashes = self._hashes(state, prompt, (len(prompt) - 1) // self.block_size)
        limit = len(hashes)
        for g, group in enumerate(self.groups):
            if group.window is None:
                limit = self._full_hit(g, hashes, limit)
        for g, group in enumerate(self.groups):
            if group.window is not None:
                limit = self._window_hit(g, group.window, hashes, limit)
        if limit == 0:
            return empty
        blocks = []
        for g, group in enumerate(self.groups):
            first = self._first_needed_block(group.window, limit * self.block_size)
            # every hash below `limit` is cached: found above
            found = cast("list[KVBlock]", [self.pool.lookup(g, h) for h in hashes[first:limit]])
            blocks.append([self.pool.blocks[NULL_BLOCK]] * first + found)
        self.stats.hits += limit * self.block_size
        return PrefixHit(limit * self.block_size, blocks)

    def _full_hit(self, g: int, hashes: list[BlockHash], limit: int) -> int:
        for i in range(limit):
            if self.pool.lookup(g, hashes[i]) is None:
                return i
        return limit

    def _window_hit(self, g: int, window: int, hashes: list[BlockHash], limit: int) -> int:
        best, run = 0, 0
        for i in range(limit):
            run = run + 1 if self.pool.lookup(g, hashes[i]) is not None else 0
            n = i + 1                                     # candidate hit length in blocks
            if run >= n - self._first_needed_block(window, n * self.block_size):
                best = n
        return best

    def _first_needed_block(self, window: int | None, next_pos: int) -> int:
        """First block a query at `next_pos` (or later) can see."""
        if window is None:
            return 0
        return max(next_pos - window + 1, 0) // self.block_size

    # -- allocation ---------------------------------------------------------------------
    def allocate(self, req_id: str, num_computed: int, num_tokens: int,
                 hit: PrefixHit | None = None) -> bool:
        """Make room for tokens [num_computed, num_tokens). With a prefix `hit` (first
        allocation only) the hit's blocks are referenced. All or nothing: returns
        False, changing nothing, when the pool cannot supply enough blocks."""
        state = self.requests.get(req_id)
        if state is None:
            state = self.requests[req_id] = self._new_state()
        elif (num_tokens <= state.fits_tokens and num_computed <= state.fits_computed
              and (hit is None or not hit.num_tokens)):
            return True
        state.ids = None                                 # the tables may change below
        if hit is not None and hit.num_tokens:
            if any(state.tables):
                raise AssertionError(f"request {req_id}: prefix hit on a non-empty table")
            revived = sum(b.ref_cnt == 0 for blocks in hit.blocks for b in blocks)
        else:
            hit, revived = None, 0
        self._skip_out_of_window(state, num_computed)
        need = 0
        for g, group in enumerate(self.groups):
            have = len(hit.blocks[g]) if hit else len(state.tables[g])
            first = self._first_needed_block(group.window, num_computed)
            total = -(-num_tokens // self.block_size)
            need += max(total - max(have, first), 0)
        if need + revived > self.pool.num_free:
            return False
        for g, group in enumerate(self.groups):
            table = state.tables[g]
            if hit:
                self.pool.touch(b for b in hit.blocks[g] if b.block_id != NULL_BLOCK)
                table.extend(hit.blocks[g])
                state.num_cached[g] = len(hit.blocks[g])
            first = self._first_needed_block(group.window, num_computed)
            while len(table) < first:
                table.append(self.pool.blocks[NULL_BLOCK])
            missing = -(-num_tokens // self.block_size) - len(table)
            if missing > 0:
                table.extend(self.pool.allocate(missing))
        self._set_fits(state, num_computed)
        return True

    def _set_fits(self, state: _RequestState, num_computed: int) -> None:
        """How far `allocate` may skip its work for this request: up to the tables'
        capacity, and while every window group's first needed block stays where it is
        now (`_first_needed_block` only grows with num_computed; smaller ones need
        nothing either: their out-of-window blocks are already released)."""
        B = self.block_size
        state.fits_tokens = min(len(t) for t in state.tables) * B if state.tables else 0
        fits = sys.maxsize
        for group in self.groups:
            if group.window is not None:
                first = self._first_needed_block(group.window, num_computed)
                # the smallest num_computed whose first needed block is first + 1, less one
                fits = min(fits, (first + 1) * B + group.window - 2)
        state.fits_computed = fits

    def _skip_out_of_window(self, state: _RequestState, num_computed: int) -> None:
        """Release sliding-window blocks no future query can see."""
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            table = state.tables[g]
            first = min(self._first_needed_block(group.window, num_computed), len(table))
            gone = [b for b in table[:first] if b.block_id != NULL_BLOCK]
            if gone:
                self.pool.release(reversed(gone))
                for i in range(first):
                    table[i] = self.pool.blocks[NULL_BLOCK]

    def shrink(self, req_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those holding tokens [0, num_tokens): the
        lookahead slots of rejected draft tokens (speculative decoding). None of them is
        in the prefix cache: only blocks full of computed tokens are."""
        state = self.requests.get(req_id)
        if state is None:
            return
        keep = -(-num_tokens // self.block_size)
        for table in state.tables:
            if len(table) > keep:
                self.pool.release(reversed(table[keep:]))
                del table[keep:]
                state.ids = None
        state.fits_tokens = min(state.fits_tokens, keep * self.block_size)

    def cache_blocks(self, req_id: str, tokens: Sequence[int], num_computed: int) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        state = self.requests[req_id]
        num_full = num_computed // self.block_size
        hashes = self._hashes(state, tokens, num_full)
        events = self.pool.events
        for g, table in enumerate(state.tables):
            end = min(num_full, len(table))
            if events is None:
                for i in range(state.num_cached[g], end):
                    if table[i].block_id != NULL_BLOCK:
                        self.pool.cache(table[i], g, hashes[i])
            else:
                self._cache_recording(events, g, table, hashes, tokens, state.num_cached[g], end)
            state.num_cached[g] = max(state.num_cached[g], end)

    def _cache_recording(self, events: list[CacheEvent], g: int, table: list[KVBlock],
                         hashes: list[BlockHash], tokens: Sequence[int], start: int,
                         end: int) -> None:
        """`cache_blocks` for one group, recording one `Stored` per run of consecutive
        blocks that entered the cache (a null block, or a hash another block already
        holds, ends a run)."""
        B, run = self.block_size, -1
        for i in range(start, end + 1):
            entered = (i < end and table[i].block_id != NULL_BLOCK
                       and self.pool.cache(table[i], g, hashes[i]))
            if entered and run < 0:
                run = i
            elif not entered and run >= 0:
                events.append(Stored(g, hashes[run:i], hashes[run - 1] if run else None,
                                     list(tokens[run * B:i * B])))
                run = -1

    def take_events(self) -> list[CacheEvent]:
        """The KV cache events recorded since the last call (empty when events are off)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False, changing nothing, while blocks are in use)."""
        return self.pool.reset_prefix_cache()

    def free(self, req_id: str) -> None:
        """Release every block of the request (tail first, so its last blocks are
        evicted first); safe to call for unknown or already freed requests."""
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        for table in state.tables:
            self.pool.release(reversed(table))

    def _new_state(self) -> _RequestState:
        return _RequestState([[] for _ in self.groups], [0 for _ in self.groups])

    # -- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool invariants, and every block's ref count equals the tables holding it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for state in self.requests.values():
            for table in state.tables:
                for b in table:
                    if b.block_id != NULL_BLOCK:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            if block.ref_cnt != holders.get(block.block_id, 0):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt} but held "
                                     f"by {holders.get(block.block_id, 0)} table entries")

    def assert_no_leaks(self) -> None:
        """No request holds blocks and every block but the null block is free."""
        self.check_integrity()
        held = [r for r, s in self.requests.items()
                if any(b.block_id != NULL_BLOCK for t in s.tables for b in t)]
        if held or self.pool.num_free != self.pool.num_blocks - 1:
            raise AssertionError(f"KV blocks leaked: {self.pool.num_used} in use, held by {held}")
