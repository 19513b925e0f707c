"""One backend's cached blocks, rebuilt from its KV events (`BackendView`), and the
names this proxy gives them.

Each stored block is kept under (group, engine hash) and under a key of its own computed
from the tokens of its whole prefix (`prefix_key`: the proxy's own chain hash, prefix.py,
from the root `EVENTS_ROOT`, chained from the event's parent), so a router can ask how many
leading blocks of a prompt a backend holds (`KVEventSubscriber.cached_prefix_blocks`, or
with the keys already computed, `cached_prefix_keys`) without knowing the engine's hash
function (what llm-d does with vLLM's events).

The view is plain bookkeeping: `KVEventSubscriber` (kv_events.py) owns the sockets and the
sequence numbers and calls `apply` under its lock, batch by batch, in order.
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.kv_events.wire import (
    ExternalHash,
    WireBatch,
    WireCleared,
    WireRemoved,
    WireStored,
)
from kvrelay.proxy.prefix import EVENTS_ROOT, BlockHash, chain_hash


def prefix_key(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """This subscriber's name for a block: the proxy's chain hash (prefix.chain_hash) over its
    parent's key and its tokens as little-endian int64, from `EVENTS_ROOT`. Equal prefixes,
    equal keys, whatever the engine's own hash."""
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return chain_hash(parent if parent is not None else EVENTS_ROOT, packed)


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The keys of the full blocks of `token_ids`."""
    keys: list[BlockHash] = []
    parent = None
    for b in range(len(token_ids) // block_size):
        parent = prefix_key(parent, token_ids[b * block_size:(b + 1) * block_size])
        keys.append(parent)
    return keys


@dataclass
class BackendStats:
    batches: int = 0             # batches applied
    replays: int = 0             # replay requests sent
    lost: int = 0                # sequence numbers no replay could supply
    restarts: int = 0            # times the publisher's sequence went back (state cleared)
    orphans: int = 0             # stored blocks whose parent was unknown (no prefix key)
    errors: int = 0              # undecodable messages


@dataclass
class BackendView:
    """One backend's cached blocks, as its events say."""
    name: str
    block_size: int | None = None
    blocks: dict[tuple[int, ExternalHash], bytes | None] = field(default_factory=dict)
    keys: dict[tuple[int, bytes], int] = field(default_factory=dict)     # key → engine blocks
    next_seq: int = 0                          # the sequence number expected next
    seen_ts: OrderedDict[int, float] = field(default_factory=OrderedDict)  # recent seq → ts
    last_ts: float = 0.0                       # ts of the last batch applied
    stats: BackendStats = field(default_factory=BackendStats)
    last_message: float = 0.0                  # monotonic time of the last message read

    def clear(self) -> None:
        self.blocks.clear()
        self.keys.clear()
        self.seen_ts.clear()
        self.last_ts = 0.0

    def is_new_publisher(self, seq: int, batch: WireBatch) -> bool:
        """A batch under a seq already applied that is not the one applied: a different
        timestamp under that seq, or (its ts forgotten) one later than anything applied."""
        if seq >= self.next_seq:
            return False
        seen = self.seen_ts.get(seq)
        return batch.ts != seen if seen is not None else batch.ts > self.last_ts

    def apply(self, batch: WireBatch) -> None:
        for event in batch.events:
            if isinstance(event, WireStored):
                self._store(event)
            elif isinstance(event, WireRemoved):
                group = event.group_idx or 0
                for h in event.block_hashes:
                    self._forget(group, h)
            elif isinstance(event, WireCleared):
                self.clear()
        self.stats.batches += 1

    def _store(self, event: WireStored) -> None:
        group, B = event.group_idx or 0, event.block_size
        self.block_size = B
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent = self.blocks.get((group, event.parent_block_hash))
        known_parent = event.parent_block_hash is None or parent is not None
        for i, h in enumerate(event.block_hashes):
            key: bytes | None = None
            tokens = event.token_ids[i * B:(i + 1) * B]
            if known_parent and len(tokens) == B:
                key = parent = prefix_key(parent, tokens)
            else:
                known_parent = False
                self.stats.orphans += 1
            self._forget(group, h)            # a store of a held hash replaces it
            self.blocks[(group, h)] = key
            if key is not None:
                self.keys[(group, key)] = self.keys.get((group, key), 0) + 1

    def _forget(self, group: int, h: ExternalHash) -> None:
        key = self.blocks.pop((group, h), None)
        if key is not None:
            n = self.keys.get((group, key), 0) - 1
            if n > 0:
                self.keys[(group, key)] = n
            else:
                self.keys.pop((group, key), None)
