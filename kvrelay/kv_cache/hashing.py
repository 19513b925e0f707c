"""Chained block hashes for prefix caching.

    block 0: h0 = H(ROOT, tokens[0:B])
    block 1: h1 = H(h0,   tokens[B:2B])
    ...

A hash names a block's tokens *and everything before them*. It is SHA-256 over a
fixed byte encoding (little-endian int64 token ids), so it is identical across
processes, Python versions and machines — prefill and decode servers agree on it.
Only full blocks are hashed.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Distinguishes hash schemes (and models, via `root_hash(seed)`) from each other.
_SCHEME = b"kvrelay-block-hash-v1"


def root_hash(seed: str = "") -> BlockHash:
    """The parent of block 0; `seed` can namespace caches (e.g. a model fingerprint)."""
    return hashlib.sha256(_SCHEME + seed.encode()).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(extra)
    return h.digest()


def hash_blocks(tokens: Sequence[int], block_size: int, parent: BlockHash | None = None,
                start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `tokens` from `start_block` on, chained from
    `parent` (the hash of block `start_block - 1`, or the root)."""
    parent = parent if parent is not None else root_hash()
    out: list[BlockHash] = []
    for b in range(start_block, len(tokens) // block_size):
        parent = hash_block(parent, tokens[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out
