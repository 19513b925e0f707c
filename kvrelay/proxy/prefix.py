"""Which server holds which prompt prefix: the proxy's side of prefix caching.

A prompt becomes a chain of block keys, built as the servers build their block hashes
(SHA-256 over the parent's key and the block's int64s; `chain_hash`), cut to 16 bytes:
block i's key names its content and everything before it, so two prompts share leading
keys exactly as long as they share a prefix.

The proxy has no tokenizer (the tutorial's command line gives it no model), so:

- a completion whose `prompt` is token ids is hashed in `block_size`-token blocks;
- any other prompt is rendered to canonical text (a chat's messages: role and content in
  order, tools first, as the chat template places them) and hashed in chunks of
  `block_size * chars_per_token` characters — about one server block each.

The hashes are the proxy's own keys, not the servers' block hashes (those depend on the
token ids); all the proxy needs is that a shared prefix gives shared leading keys, and a
block-sized chunk keeps the bookkeeping in step with what a server can cache.

With KV events (`--kv-events-port`, proxy/kv_events.py) a token-id prompt also gets
`token_keys`: the same chain over its ids from a root shared by every model
(`EVENTS_ROOT`), the keys the event subscriber gives the blocks servers report, so a
server's events answer "how many leading blocks does it hold" exactly (`CachedPrefixes`).

`PrefixTable` remembers, per server, the chains the proxy sent it, least recently used
first, bounded per server (by the server's KV capacity once its /metrics report it, else
a flag), and answers "how many leading blocks of this prompt does each server hold".
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

from kvrelay import rawjson
from kvrelay.kv_cache.hashing import root_hash

DEFAULT_BLOCK_SIZE = 16            # kvrelay serve's and vLLM's default --block-size
DEFAULT_CHARS_PER_TOKEN = 4.0      # English text with gpt-oss's o200k tokenizer: ~4 chars/token
DEFAULT_SERVER_BLOCKS = 65536      # per-server bound before its /metrics say its KV capacity
# Only a prompt's first blocks are hashed (16 tokens x 8192 = gpt-oss's 131072-token context):
# hashing runs on the proxy's event loop, and a 32 MiB body must not stall it.
MAX_KEY_BLOCKS = 8192
# Pieces of text read for a key (a message is at least one): a chat of six million `null`
# messages renders as nothing, and walking all of them would take seconds.
MAX_KEY_PIECES = 1 << 18


BlockHash = bytes
DIGEST_BYTES = 16                  # a block's key: SHA-256 of its parent and content, cut short


class HashChain(Sequence[BlockHash]):
    """A prompt's block keys in one bytes object (8,192 keys: 128 KiB, not the ~650 KiB of
    8,192 bytes objects a request would hold in flight)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes = b"") -> None:
        self.blob = blob

    def __len__(self) -> int:
        return len(self.blob) // DIGEST_BYTES

    @overload
    def __getitem__(self, i: int) -> BlockHash: ...

    @overload
    def __getitem__(self, i: slice) -> HashChain: ...

    def __getitem__(self, i: int | slice) -> BlockHash | HashChain:
        if isinstance(i, slice):
            return HashChain(b"".join(self[k] for k in range(*i.indices(len(self)))))
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.blob[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HashChain):
            return self.blob == other.blob
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(self.blob)

    def __repr__(self) -> str:
        return f"HashChain({len(self)} blocks)"


def chain_hash(parent: BlockHash, packed: bytes) -> BlockHash:
    """The key of a block whose content is `packed` (little-endian int64s) after `parent`."""
    h = hashlib.sha256(parent)
    h.update(packed)
    return h.digest()[:DIGEST_BYTES]


def chain_root(seed: str) -> BlockHash:
    return root_hash(seed)[:DIGEST_BYTES]


EVENTS_ROOT = chain_root("kv-events")   # token_keys' root: the KV-event subscriber's keys


@dataclass(frozen=True)
class PromptKey:
    """A request's prompt as the router sees it."""

    hashes: Sequence[BlockHash]
    tokens: int                    # exact for token-id prompts, estimated for text
    tokens_per_block: float
    # the token-id chain from EVENTS_ROOT (a single token-id prompt, with KV events on)
    token_keys: Sequence[BlockHash] | None = None

    def cached_tokens(self, blocks: int) -> int:
        return min(self.tokens, int(blocks * self.tokens_per_block))


class CachedPrefixes(Protocol):
    """What a router may consult besides its own table (proxy/kv_events.py's feed)."""

    def refine(self, key: PromptKey, matched: dict[str, int]) -> dict[str, int]:
        """`matched` (server → leading blocks held) with better counts where it has them."""
        ...


@dataclass(frozen=True)
class Hasher:
    block_size: int = DEFAULT_BLOCK_SIZE
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    token_keys: bool = False       # also key token-id prompts for KV events (`token_keys`)

    @property
    def chunk_chars(self) -> int:
        return max(1, round(self.block_size * self.chars_per_token))

    def key(self, path: str, body: Mapping[str, Any], raw_size: int = 0) -> PromptKey:
        """The key of a body whose values are parsed or `rawjson.RawJSON` (a large body's
        fields: `body.ClientBody.fields`; the same key either way). Only the first
        MAX_KEY_BLOCKS blocks are hashed; past them a parsed body's length is counted and a
        raw one's estimated from `raw_size` (its prompt's bytes: such a prompt is longer
        than gpt-oss's context anyway)."""
        model = body.get("model")
        model = model if isinstance(model, str) else str(model or "")   # models never share
        ids = _token_ids(body.get("prompt")) \
            if path.endswith("/completions") and "messages" not in body else None
        if ids is not None:
            count, values = ids
            hashes = _hash_stream(values, self.block_size, chain_root(f"ids:{model}"),
                                  MAX_KEY_BLOCKS)
            return PromptKey(hashes, count, float(self.block_size),
                             self._token_keys(body.get("prompt")))
        chunks = _TextChunks(self.chunk_chars, chain_root(f"text:{model}"), MAX_KEY_BLOCKS)
        pieces = text_pieces(body)
        cut = False
        for n, piece in enumerate(pieces):
            if not chunks.add(piece) or n >= MAX_KEY_PIECES:
                cut = True
                break
        chars = chunks.chars
        if cut:
            if raw_size:
                chars = max(chars, raw_size)
            else:
                chars += sum(len(piece) for piece in pieces)
        return PromptKey(HashChain(bytes(chunks.blob)),
                         math.ceil(chars / self.chars_per_token),
                         self.chunk_chars / self.chars_per_token)


    def _token_keys(self, prompt: Any) -> HashChain | None:
        """The events' keys of a single token-id prompt (a batch's server-side blocks are
        each prompt's own: not one chain)."""
        if not self.token_keys or not _id_list(prompt):
            return None
        return _hash_stream(_ids(prompt), self.block_size, EVENTS_ROOT, MAX_KEY_BLOCKS)


class _TextChunks:
    """Hashes text `chunk` characters at a time as it arrives, each character as its code
    point (as token ids are: `_code_points`)."""

    def __init__(self, chunk: int, root: BlockHash, max_blocks: int) -> None:
        self.chunk = chunk
        self.parent = root
        self.max_blocks = max_blocks
        self.blob = bytearray()
        self.chars = 0
        self._pending = ""

    @property
    def full(self) -> bool:
        return len(self.blob) >= self.max_blocks * DIGEST_BYTES

    def add(self, text: str) -> bool:
        """Takes `text`; False once the last block is hashed (the rest is not needed)."""
        self.chars += len(text)
        pending = self._pending + text
        start = 0
        while len(pending) - start >= self.chunk and not self.full:
            self.parent = chain_hash(self.parent, _code_points(pending[start:start + self.chunk]))
            self.blob += self.parent
            start += self.chunk
        self._pending = "" if self.full else pending[start:]
        return not self.full


def _code_points(text: str) -> bytes:
    """`text`'s code points as little-endian int64s (struct.pack("<Nq", *map(ord, text)))."""
    narrow = text.encode("utf-32-le", "surrogatepass")
    wide = bytearray(2 * len(narrow))
    for k in range(4):
        wide[k::8] = narrow[k::4]
    return bytes(wide)


def _hash_stream(values: Iterator[int], block_size: int, parent: BlockHash,
                 max_blocks: int) -> HashChain:
    """The keys of the first `max_blocks` full blocks of `values`, read lazily."""
    out = bytearray()
    while len(out) < max_blocks * DIGEST_BYTES:
        block = list(itertools.islice(values, block_size))
        if len(block) < block_size:
            break
        parent = chain_hash(parent, struct.pack(f"<{block_size}q", *block))
        out += parent
    return HashChain(bytes(out))


def _is_id(t: Any) -> bool:
    """An int the servers' hashing can pack (int64); anything else is keyed as text (the
    server will judge the request; the router must not fail on it)."""
    return type(t) is int and -(1 << 63) <= t < (1 << 63)


_FLAT_IDS = re.compile(rb"\[[ \t\r\n]*-?\d++(?:[ \t\r\n]*,[ \t\r\n]*-?\d++)*+[ \t\r\n]*\]")
_INT = re.compile(rb"-?\d++")
_LONG_INT = re.compile(rb"-?\d{19,}")


def _token_ids(prompt: Any) -> tuple[int, Iterator[int]] | None:
    """A `prompt` given as token ids (one list, or a batch of lists joined with a -1 after
    each: a separator no tokenizer produces): how many, and the ids; else None."""
    if _id_list(prompt):
        return _id_count(prompt), _ids(prompt)
    if not rawjson.is_array(prompt) or _empty(prompt):
        return None
    count = 0
    for p in rawjson.elements(prompt):
        if not (_id_list(p) or p == []):
            return None
        count += _id_count(p) + 1
    return count, itertools.chain.from_iterable(
        itertools.chain(_ids(p), (-1,)) for p in rawjson.elements(prompt))


def _empty(value: Any) -> bool:
    return not value if isinstance(value, list) else False


def _id_list(value: Any) -> bool:
    """A non-empty list of int64 token ids (parsed, or raw text checked without parsing)."""
    if isinstance(value, list):
        return bool(value) and all(_is_id(t) for t in value)
    if not (isinstance(value, rawjson.RawJSON) and value.kind == "["):
        return False
    if _FLAT_IDS.fullmatch(value.buf) is None:
        return False
    return all(_is_id(int(m.group())) for m in _LONG_INT.finditer(value.buf))


def _id_count(ids: Any) -> int:
    if isinstance(ids, list):
        return len(ids)
    buf = ids.buf
    window = 64 * 1024
    return 1 + sum(bytes(buf[i:i + window]).count(b",") for i in range(0, buf.nbytes, window))


def _ids(ids: Any) -> Iterator[int]:
    if isinstance(ids, list):
        return iter(ids)
    return (int(m.group()) for m in _INT.finditer(ids.buf))


def render(body: Mapping[str, Any]) -> str:
    """Canonical text of a request's prompt: what comes first in the model's context first."""
    return "".join(text_pieces(body))


def text_pieces(body: Mapping[str, Any]) -> Iterator[str]:
    """`render`'s text in order, piece by piece (values parsed or raw: the same text)."""
    if "messages" in body:
        tools = body.get("tools")
        if isinstance(tools, rawjson.RawJSON) or tools:
            yield "<|tools|>"
            yield from _dumps(tools)
        messages = body["messages"]
        listed = rawjson.is_array(messages) or isinstance(messages, Iterator)
        for m in rawjson.elements(messages) if listed else [messages]:
            yield ""                                  # one piece at least: the key counts them
            if rawjson.is_object(m):
                m = rawjson.members(m)
                yield f"<|{m.get('role')}|>"
                yield from _content(m.get("content"))
                yield from _content(m.get("tool_calls"))
                yield "<|end|>"
            else:
                yield from _content(m)
        return
    prompt = body.get("prompt")
    if rawjson.is_array(prompt) and all(rawjson.is_string(p)
                                        for p in rawjson.elements(prompt)):
        for i, p in enumerate(rawjson.elements(prompt)):
            if i:
                yield "\x00"
            yield from rawjson.string_windows(p)
        return
    yield from _content(prompt)


def _content(value: Any) -> Iterator[str]:
    if value is None:
        return
    if rawjson.is_string(value):
        yield from rawjson.string_windows(value)
        return
    if rawjson.is_array(value) and all(
            rawjson.is_object(p) and rawjson.members(p).get("type") == "text"
            for p in rawjson.elements(value)):
        for p in rawjson.elements(value):
            text = rawjson.members(p).get("text", "")
            if rawjson.is_string(text):
                yield from rawjson.string_windows(text)
            else:
                yield str(rawjson.parsed(text))
        return
    yield from _dumps(value)


def _dumps(value: Any) -> Iterator[str]:
    """json.dumps(value, sort_keys=True), piece by piece."""
    if not isinstance(value, rawjson.RawJSON):
        yield json.dumps(value, sort_keys=True)
    elif value.kind == '"':
        yield '"'
        for window in rawjson.string_windows(value):
            yield json.dumps(window)[1:-1]
        yield '"'
    elif value.kind == "[":
        yield "["
        for i, element in enumerate(rawjson.elements(value)):
            if i:
                yield ", "
            yield from _dumps(element)
        yield "]"
    elif value.kind == "{":
        yield "{"
        fields = rawjson.members(value)
        for i, name in enumerate(sorted(fields)):
            yield f"{', ' if i else ''}{json.dumps(name)}: "
            yield from _dumps(fields[name])
        yield "}"
    else:
        yield json.dumps(rawjson.parsed(value))


class PrefixTable:
    """Per server: the block hashes the proxy sent it, least recently used first.

    Bounded: each server keeps at most `capacity(server)` blocks (its KV capacity when
    known — a server's prefix cache drops its least recently used blocks once full, and
    so does the table); a server that restarts or goes down is forgotten whole."""

    def __init__(self, default_capacity: int = DEFAULT_SERVER_BLOCKS) -> None:
        self.default_capacity = default_capacity
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def blocks(self, server: str) -> int:
        return len(self._lru.get(server, ()))

    def capacity(self, server: str) -> int:
        return self._capacity.get(server, self.default_capacity)

    def set_capacity(self, server: str, blocks: int) -> None:
        """The server's KV capacity in blocks (from its /metrics); trims to it."""
        self._capacity[server] = max(1, int(blocks))
        self._trim(server)

    def match(self, hashes: Sequence[BlockHash], servers: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each server holds (0 when none)."""
        out: dict[str, int] = {}
        for server in servers:
            lru = self._lru.get(server)
            n = 0
            if lru:
                for h in hashes:
                    if h not in lru:
                        break
                    n += 1
            out[server] = n
        return out

    def record(self, hashes: Sequence[BlockHash], server: str) -> None:
        """`server` now holds these blocks (it computed or received them): most recent."""
        lru = self._lru.setdefault(server, OrderedDict())
        # Last block first, so the first is the most recent: trimming then drops a chain's
        # tail before its head, as a server's cache evicts (a head alone still matches).
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        self._trim(server)

    def evict(self, server: str, blocks: int) -> int:
        """Drop `server`'s `blocks` least recently used blocks (it evicted them); returns how
        many were dropped."""
        lru = self._lru.get(server)
        n = 0
        while lru and n < blocks:
            lru.popitem(last=False)
            n += 1
        return n

    def forget(self, server: str) -> int:
        """Drop everything `server` was thought to hold; returns how many blocks."""
        return len(self._lru.pop(server, ()))

    def drop(self, server: str) -> None:
        """`server` is gone (drained and removed): its entries and its known capacity."""
        self._lru.pop(server, None)
        self._capacity.pop(server, None)

    def _trim(self, server: str) -> None:
        lru = self._lru.get(server)
        if lru is None:
            return
        cap = self.capacity(server)
        while len(lru) > cap:
            lru.popitem(last=False)
