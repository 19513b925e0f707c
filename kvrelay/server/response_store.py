"""The Responses API store: what `store: true` keeps for GET, DELETE and `previous_response_id`.

Owner: the API process; a lock, as `previous_response_id` is read on the prep workers
(server/prep.py) while the event loop stores. Bounded three ways, so no client can
grow it without limit:

- entries: at most `max_entries` (KVRELAY_RESPONSES_STORE_MAX_ENTRIES, 1000);
- bytes: at most `max_bytes` in all (KVRELAY_RESPONSES_STORE_MAX_BYTES, 256 MiB), counted
  as the UTF-8 JSON of the response plus its conversation; the least recently used entries
  are evicted first until both bounds hold;
- one entry: at most `max_entry_bytes` (KVRELAY_RESPONSES_STORE_MAX_ENTRY_BYTES, 16 MiB);
  a larger response is answered but not kept (its `store` says false).

`metadata` follows OpenAI's limits (16 pairs, keys ≤ 64 characters, string values ≤ 512
characters): anything else is a 400 before the request runs.

Each entry belongs to the client that created it: `owner_of` names the owner (the value of
the operator's `--responses-owner-header` when set, else the request's Authorization
header), kept as a SHA-256 digest. `get` and `delete` by another owner find nothing, so
another key's GET, DELETE or `previous_response_id` is a 404 that says no more than an id
that never existed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.protocol import OpenAIError

logger = logging.getLogger(__name__)

METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


@dataclass(frozen=True)
class StoreLimits:
    """The store's bounds (0 entries: no store at all)."""
    max_entries: int = 1000
    max_bytes: int = 256 << 20
    max_entry_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.max_entries < 0:
            raise ValueError(f"responses store size must be >= 0, got {self.max_entries}")
        if self.max_bytes < 1 or self.max_entry_bytes < 1:
            raise ValueError("responses store byte limits must be >= 1, got "
                             f"{self.max_bytes} / {self.max_entry_bytes}")


@dataclass
class StoredResponse:
    body: dict[str, Any]              # the response object, as returned
    messages: list[dict[str, Any]]    # the conversation through this response (chat messages)
    owner: str = ""                   # owner_of(...) of the request that created it
    size: int = field(default=0, compare=False)   # bytes counted against the budget


def entry_size(item: StoredResponse) -> int:
    """The bytes an entry counts for: its response and conversation as UTF-8 JSON."""
    return sum(len(json.dumps(part, ensure_ascii=False, default=str).encode())
               for part in (item.body, item.messages))


class ResponseStore:
    """Responses kept for their owners, least recently used evicted first (see module)."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limits.max_entries > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: StoredResponse) -> bool:
        """Keep `item`; False (nothing kept) when the store is off or the entry is larger
        than `max_entry_bytes`."""
        if not self.enabled:
            return False
        item.size = entry_size(item)
        if item.size > self.limits.max_entry_bytes:
            logger.warning("responses store: %s not kept (%d bytes; at most %d: "
                           "KVRELAY_RESPONSES_STORE_MAX_ENTRY_BYTES)", item.body["id"],
                           item.size, self.limits.max_entry_bytes)
            return False
        with self._lock:
            self._drop(item.body["id"])
            self._items[item.body["id"]] = item
            self.bytes += item.size
            while (len(self._items) > self.limits.max_entries
                   or self.bytes > self.limits.max_bytes):
                evicted, old = self._items.popitem(last=False)
                self.bytes -= old.size
                logger.debug("responses store full: evicted %s", evicted)
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is None or item.owner != owner:
                return None
            self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            item = self._items.get(response_id)
            if item is None or item.owner != owner:
                return False
            self._drop(response_id)
            return True

    def _drop(self, response_id: str) -> None:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size


def owner_of(headers: Mapping[str, str], owner_header: str | None) -> str:
    """Who a request acts for: the operator's owner header when configured (set by a trusted
    gateway in front), else the Authorization header; "" for an anonymous client. A digest,
    so the store never holds a key."""
    value = headers.get(owner_header.lower() if owner_header else "authorization") or ""
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest() if value else ""


def check_metadata(metadata: Any) -> None:
    """OpenAI's metadata limits; OpenAIError (400, param `metadata`) otherwise."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise OpenAIError("metadata must be an object of string keys and values",
                          param="metadata")
    check_metadata_pairs(len(metadata), ((key, isinstance(value, str),
                                          len(value) if isinstance(value, str) else 0)
                                         for key, value in metadata.items()))


def check_metadata_pairs(count: int, pairs: Iterable[tuple[str, bool, int]]) -> None:
    """`check_metadata` of an object of `count` members, given as (key, is a string, its
    length in characters): also for a body not parsed yet (`limits.check_raw_fields`)."""
    if count > METADATA_MAX_PAIRS:
        raise OpenAIError(f"metadata: at most {METADATA_MAX_PAIRS} key-value pairs, got "
                          f"{count}", param="metadata")
    for key, is_text, chars in pairs:
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise OpenAIError(f"metadata: keys are at most {METADATA_MAX_KEY_CHARS} characters, "
                              f"got one of {len(key)}", param="metadata")
        if not is_text:
            raise OpenAIError(f"metadata.{key}: values must be strings",
                              param=f"metadata.{key}")
        if chars > METADATA_MAX_VALUE_CHARS:
            raise OpenAIError(f"metadata.{key}: values are at most {METADATA_MAX_VALUE_CHARS} "
                              f"characters, got {chars}", param=f"metadata.{key}")
