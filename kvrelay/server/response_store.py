"""The Responses API store: what `store: true` keeps for GET, DELETE, cancel and
`previous_response_id`.

Two kinds, one rule set (`ResponseStore`): `MemoryResponseStore` keeps the entries in this
process; `SqliteResponseStore` (server/response_sqlite.py, `kvrelay serve`'s default) keeps
them in a SQLite file under the state directory, so they survive a restart
(`response_sqlite.open_store` picks one from the flags). Both are
bounded three ways, so no client can grow them without limit:

- entries: at most `max_entries` (KVRELAY_RESPONSES_STORE_MAX_ENTRIES, 1000);
- bytes: at most `max_bytes` in all (KVRELAY_RESPONSES_STORE_MAX_BYTES, 256 MiB), counted
  as the UTF-8 JSON of the response plus its conversation; the least recently used entries
  (created, replaced or read longest ago) are evicted first until both bounds hold;
- one entry: at most `max_entry_bytes` (KVRELAY_RESPONSES_STORE_MAX_ENTRY_BYTES, 16 MiB);
  a larger response is answered but not kept (its `store` says false).

`metadata` follows OpenAI's limits (16 pairs, keys ≤ 64 characters, string values ≤ 512
characters): anything else is a 400 before the request runs.

Each entry belongs to the client that created it: `owner_of` names the owner (the value of
the operator's `--responses-owner-header` when set, else the request's Authorization
header), kept as a SHA-256 digest. `get` and `delete` by another owner find nothing, so
another key's GET, DELETE, cancel or `previous_response_id` is a 404 that says no more than
an id that never existed.
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
# a background response that has not finished yet (server/response_background.py)
UNFINISHED = ("queued", "in_progress")


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

    @property
    def id(self) -> str:
        return self.body["id"]


@dataclass(frozen=True)
class Encoded:
    """An entry as UTF-8 JSON text: what the budget counts and what SQLite keeps."""
    body: str
    messages: str

    @property
    def size(self) -> int:
        return len(self.body.encode()) + len(self.messages.encode())

    @classmethod
    def of(cls, item: StoredResponse) -> Encoded:
        return cls(_dumps(item.body), _dumps(item.messages))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def entry_size(item: StoredResponse) -> int:
    """The bytes an entry counts for: its response and conversation as UTF-8 JSON."""
    return Encoded.of(item).size


@dataclass
class _Meta:
    owner: str
    size: int


class ResponseStore:
    """Responses kept for their owners, least recently used evicted first (see module).

    Owner of the index (id → owner and size, least recently used first) and of the budget
    arithmetic, under one lock: `previous_response_id` is read on the prep workers
    (server/prep.py) and GET on a thread while the event loop stores. Subclasses keep the
    payloads (`_keep`, `_load`, `_discard`, `_touched`); the index is the truth of what
    exists, so a payload is looked up only for an id the index holds for that owner.
    """

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.bytes = 0
        self._index: OrderedDict[str, _Meta] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limits.max_entries > 0

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._index

    def put(self, item: StoredResponse) -> bool:
        """Keep `item` (replacing an entry of the same id); False (nothing kept) when the
        store is off or the entry is larger than `max_entry_bytes`."""
        if not self.enabled:
            return False
        encoded = Encoded.of(item)
        item.size = encoded.size
        if item.size > self.limits.max_entry_bytes:
            logger.warning("responses store: %s not kept (%d bytes; at most %d: "
                           "KVRELAY_RESPONSES_STORE_MAX_ENTRY_BYTES)", item.id, item.size,
                           self.limits.max_entry_bytes)
            return False
        with self._lock:
            self._unindex(item.id)
            self._index[item.id] = _Meta(item.owner, item.size)
            self.bytes += item.size
            evicted = self._over_budget()
            self._keep(item, encoded)
            if evicted:
                self._discard(evicted)
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            meta = self._index.get(response_id)
            if meta is None or meta.owner != owner:
                return None
            self._index.move_to_end(response_id)
            self._touched(response_id)
        return self._load(response_id)

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            meta = self._index.get(response_id)
            if meta is None or meta.owner != owner:
                return False
            self._unindex(response_id)
            self._discard([response_id])
            return True

    def close(self) -> None:
        """Write out what is pending (SQLite); the memory store has nothing to do."""

    # -- the index (callers hold the lock)

    def _reindex(self, response_id: str, owner: str, size: int) -> None:
        """An entry that exists already (a store reopened), as the most recently used."""
        self._index[response_id] = _Meta(owner, size)
        self.bytes += size

    def _unindex(self, response_id: str) -> None:
        old = self._index.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size

    def _over_budget(self) -> list[str]:
        """Drop the least recently used entries until both budgets hold; their ids."""
        evicted = []
        while len(self._index) > self.limits.max_entries or self.bytes > self.limits.max_bytes:
            response_id, old = self._index.popitem(last=False)
            self.bytes -= old.size
            evicted.append(response_id)
            logger.debug("responses store full: evicted %s", response_id)
        return evicted

    # -- the payloads (subclasses; all but _load are called with the lock held)

    def _keep(self, item: StoredResponse, encoded: Encoded) -> None:
        raise NotImplementedError

    def _load(self, response_id: str) -> StoredResponse | None:
        raise NotImplementedError

    def _discard(self, response_ids: list[str]) -> None:
        raise NotImplementedError

    def _touched(self, response_id: str) -> None:
        """`response_id` was read: it is now the most recently used."""


class MemoryResponseStore(ResponseStore):
    """The entries as objects in this process: gone when it exits."""

    def __init__(self, limits: StoreLimits) -> None:
        super().__init__(limits)
        self._items: dict[str, StoredResponse] = {}

    def _keep(self, item: StoredResponse, encoded: Encoded) -> None:
        self._items[item.id] = item

    def _load(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def _discard(self, response_ids: list[str]) -> None:
        for response_id in response_ids:
            self._items.pop(response_id, None)


def previous_conversation(previous: StoredResponse) -> list[dict[str, Any]]:
    """The conversation a `previous_response_id` continues; 400 while that response is
    still running in the background (its output is not known yet)."""
    if previous.body.get("status") in UNFINISHED:
        raise OpenAIError(f"Previous response with id '{previous.id}' has not finished "
                          f"(status {previous.body['status']}); poll it until it has",
                          param="previous_response_id")
    return list(previous.messages)


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
