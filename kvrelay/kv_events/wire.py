"""vLLM's KV-event wire format: what kvrelay publishes and what its subscriber reads.

One ZMQ multipart message per engine step that changed the prefix cache:

    [topic (utf-8), seq (8 bytes, big-endian, from 0), payload (msgpack)]

payload, a msgspec struct encoded as MessagePack, is the batch as a positional array

    [ts (float64, time.time()), [event, ...], data_parallel_rank (int)]

and each event a tagged map (vLLM after 0.23, vllm-project/vllm#42892; "type" first, then the
fields in declaration order, fields that hold their default omitted):

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": B, "lora_id": nil, "medium": "GPU", "lora_name": nil,
     "extra_keys": [nil, ...], "group_idx": g, "kv_cache_spec_kind": "full_attention"
     | "sliding_window", "kv_cache_spec_sliding_window": W (sliding groups only)}
    {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": g}
    {"type": "AllBlocksCleared"}

`KVRELAY_KV_EVENTS_ENCODING=array` publishes the events as vLLM ≤ 0.23 did (msgspec
array_like: ["BlockStored", hashes, parent, tokens, B, nil, "GPU", nil, [nil, ...], g,
kind(, W)]) for subscribers that only read that. Block hashes: kvrelay's are 32-byte
SHA-256 digests (kv_cache/hashing.py); on the wire they are, as vLLM's default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), the unsigned 64-bit integer of the digest's last 8
bytes read big-endian, or the 32 bytes as msgpack bin with
KVRELAY_KV_EVENTS_USE_INT_BLOCK_HASHES=0. The replay socket answers a request (an 8-byte
big-endian start seq) with one message per buffered batch from there, [topic, seq,
payload], then [b"", END_SEQ, b""].

`decode_batch` reads both event encodings, both hash forms and fields it does not know.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvrelay.kv_cache.events import CacheEvent, Cleared, Removed, Stored
from kvrelay.kv_cache.hashing import BlockHash

MEDIUM_GPU = "GPU"               # vLLM's name for the engine's own KV cache (CPU backend too)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("map", "array")
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"

ExternalHash = int | bytes

# vLLM's fields, in its declaration order (vllm/distributed/kv_events.py, v0.33.0); a third
# item is the default, omitted on the wire when the value equals it
_STORED = (
    ("block_hashes", list[ExternalHash]),
    ("parent_block_hash", ExternalHash | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[Any] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
    ("session_id", str | None, None),
    ("lookahead_token_ids", list[list[int]] | None, None),
)
_REMOVED = (
    ("block_hashes", list[ExternalHash]),
    ("medium", str | None),
    ("group_idx", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
)


# the last positional layout (vLLM ≤ 0.23, before #42892): every field up to the cache-spec
# ones (#40984); msgspec writes every field of an array-like struct, defaults included
_ARRAY_STORED, _ARRAY_REMOVED = _STORED[:11], _REMOVED[:3]


def _family(array_like: bool) -> dict[str, type[msgspec.Struct]]:
    def struct(name: str, spec: Sequence[tuple[Any, ...]]) -> type[msgspec.Struct]:
        return msgspec.defstruct(name, list(spec), tag=name, omit_defaults=True, gc=False,
                                 array_like=array_like, module=__name__)
    return {"BlockStored": struct("BlockStored", _ARRAY_STORED if array_like else _STORED),
            "BlockRemoved": struct("BlockRemoved", _ARRAY_REMOVED if array_like else _REMOVED),
            "AllBlocksCleared": struct("AllBlocksCleared", ())}


_EVENTS = {"map": _family(array_like=False), "array": _family(array_like=True)}

KVEventBatch = msgspec.defstruct(
    "KVEventBatch",
    [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
    array_like=True, omit_defaults=True, gc=False, module=__name__)


def external_hash(block_hash: BlockHash, as_int: bool = True) -> ExternalHash:
    """A block hash as published: the low 64 bits, big-endian (vLLM's int form), or as is."""
    return int.from_bytes(block_hash[-8:], "big") if as_int else block_hash


@dataclass(frozen=True)
class GroupSpec:
    """What a KV-cache group's BlockStored events say about it."""
    kind: str                       # FULL_ATTENTION | SLIDING_WINDOW
    sliding_window: int | None = None

    @classmethod
    def of_window(cls, window: int | None) -> GroupSpec:
        return cls(FULL_ATTENTION) if window is None else cls(SLIDING_WINDOW, window)


class WireFormat:
    """kvrelay's cache events → vLLM's wire events and batches (one engine's settings)."""

    def __init__(self, block_size: int, groups: Sequence[GroupSpec], int_hashes: bool = True,
                 encoding: str = "map", medium: str = MEDIUM_GPU) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"KV event encoding must be one of {', '.join(ENCODINGS)}, got "
                             f"{encoding!r}")
        self.block_size, self.groups = block_size, list(groups)
        self.int_hashes, self.medium = int_hashes, medium
        self.structs = _EVENTS[encoding]
        self._encoder = msgspec.msgpack.Encoder()

    def event(self, event: CacheEvent) -> msgspec.Struct:
        h = self.int_hashes
        if isinstance(event, Stored):
            spec = self.groups[event.group] if event.group < len(self.groups) else None
            return self.structs["BlockStored"](
                block_hashes=[external_hash(x, h) for x in event.hashes],
                parent_block_hash=None if event.parent is None else external_hash(event.parent, h),
                token_ids=event.token_ids, block_size=self.block_size, lora_id=None,
                medium=self.medium, lora_name=None,
                extra_keys=[None] * len(event.hashes),     # kvrelay hashes tokens only
                group_idx=event.group, kv_cache_spec_kind=spec.kind if spec else None,
                kv_cache_spec_sliding_window=spec.sliding_window if spec else None)
        if isinstance(event, Removed):
            return self.structs["BlockRemoved"](block_hashes=[external_hash(event.block_hash, h)],
                                                medium=self.medium, group_idx=event.group)
        if isinstance(event, Cleared):
            return self.structs["AllBlocksCleared"]()
        raise TypeError(f"not a KV cache event: {event!r}")

    def encode(self, ts: float, events: Sequence[CacheEvent], data_parallel_rank: int) -> bytes:
        batch = KVEventBatch(ts=ts, events=[self.event(e) for e in events],
                             data_parallel_rank=data_parallel_rank)
        return self._encoder.encode(batch)


# -- reading (subscribers) -------------------------------------------------------------------

@dataclass(frozen=True)
class WireStored:
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class WireRemoved:
    block_hashes: list[ExternalHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class WireCleared:
    pass


WireEvent = WireStored | WireRemoved | WireCleared


@dataclass(frozen=True)
class WireBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


class WireError(ValueError):
    """A payload that is not a KV event batch."""


_POSITIONAL = {"BlockStored": [n for n, *_ in _STORED], "BlockRemoved": [n for n, *_ in _REMOVED],
               "AllBlocksCleared": []}


def decode_batch(payload: bytes) -> WireBatch:
    """A batch in either event encoding (unknown event types and fields are skipped)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"not MessagePack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise WireError("a batch is [ts, events, data_parallel_rank]")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise WireError("a batch is [ts, events, data_parallel_rank]")
    decoded = [e for e in (_event(x) for x in events) if e is not None]
    return WireBatch(float(ts), decoded, rank if isinstance(rank, int) else None)


def _event(raw: Any) -> WireEvent | None:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        fields = dict(zip(_POSITIONAL.get(tag, []), raw[1:], strict=False))
    else:
        raise WireError(f"not a KV event: {raw!r}")
    try:
        if tag == "BlockStored":
            return WireStored(list(fields["block_hashes"]), fields.get("parent_block_hash"),
                              list(fields["token_ids"]), int(fields["block_size"]),
                              fields.get("medium"), fields.get("group_idx"))
        if tag == "BlockRemoved":
            return WireRemoved(list(fields["block_hashes"]), fields.get("medium"),
                               fields.get("group_idx"))
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed {tag}: {e!r}") from None
    if tag == "AllBlocksCleared":
        return WireCleared()
    return None
