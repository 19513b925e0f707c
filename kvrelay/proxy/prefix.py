"""Which server holds which prompt prefix: the proxy's side of prefix caching.

A prompt becomes a chain of block hashes with the servers' own scheme
(`kvrelay.kv_cache.hashing`, torch-free): block i's hash names its content and everything
before it, so two prompts share leading hashes exactly as long as they share a prefix.

The proxy has no tokenizer (the tutorial's command line gives it no model), so:

- a completion whose `prompt` is token ids is hashed in `block_size`-token blocks;
- any other prompt is rendered to canonical text (a chat's messages: role and content in
  order, tools first, as the chat template places them) and hashed in chunks of
  `block_size * chars_per_token` characters — about one server block each.

The hashes are the proxy's own keys, not the servers' block hashes (those depend on the
token ids); all the proxy needs is that a shared prefix gives shared leading keys, and a
block-sized chunk keeps the bookkeeping in step with what a server can cache.

`PrefixTable` remembers, per server, the chains the proxy sent it, least recently used
first, bounded per server (by the server's KV capacity once its /metrics report it, else
a flag), and answers "how many leading blocks of this prompt does each server hold".
"""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.kv_cache.hashing import BlockHash, hash_blocks, root_hash

DEFAULT_BLOCK_SIZE = 16            # kvrelay serve's and vLLM's default --block-size
DEFAULT_CHARS_PER_TOKEN = 4.0      # English text with gpt-oss's o200k tokenizer: ~4 chars/token
DEFAULT_SERVER_BLOCKS = 65536      # per-server bound before its /metrics say its KV capacity
# Only a prompt's first blocks are hashed (16 tokens x 8192 = gpt-oss's 131072-token context):
# hashing runs on the proxy's event loop, and a 32 MiB body must not stall it.
MAX_KEY_BLOCKS = 8192


@dataclass(frozen=True)
class PromptKey:
    """A request's prompt as the router sees it."""

    hashes: list[BlockHash]
    tokens: int                    # exact for token-id prompts, estimated for text
    tokens_per_block: float

    def cached_tokens(self, blocks: int) -> int:
        return min(self.tokens, int(blocks * self.tokens_per_block))


@dataclass(frozen=True)
class Hasher:
    block_size: int = DEFAULT_BLOCK_SIZE
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN

    @property
    def chunk_chars(self) -> int:
        return max(1, round(self.block_size * self.chars_per_token))

    def key(self, path: str, body: dict[str, Any]) -> PromptKey:
        model = str(body.get("model") or "")        # different models never share a cache
        ids = _token_ids(body.get("prompt")) if path.endswith("/completions") else None
        if ids is not None and "messages" not in body:
            head = ids[:MAX_KEY_BLOCKS * self.block_size]
            hashes = hash_blocks(head, self.block_size, root_hash(f"ids:{model}"))
            return PromptKey(hashes, len(ids), float(self.block_size))
        text = render(body)
        chars = [ord(c) for c in text[:MAX_KEY_BLOCKS * self.chunk_chars]]
        hashes = hash_blocks(chars, self.chunk_chars, root_hash(f"text:{model}"))
        tokens = math.ceil(len(text) / self.chars_per_token)
        return PromptKey(hashes, tokens, self.chunk_chars / self.chars_per_token)


def _is_id(t: Any) -> bool:
    """An int the servers' hashing can pack (int64); anything else is keyed as text (the
    server will judge the request; the router must not fail on it)."""
    return type(t) is int and -(1 << 63) <= t < (1 << 63)


def _token_ids(prompt: Any) -> list[int] | None:
    """Token ids of a `prompt` given as ids (one list, or a batch of lists joined), else None."""
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return prompt
    if (isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt)
            and all(_is_id(t) for p in prompt for t in p)):
        out: list[int] = []
        for p in prompt:
            out.extend(p)
            out.append(-1)                        # a separator no tokenizer produces
        return out
    return None


def render(body: dict[str, Any]) -> str:
    """Canonical text of a request's prompt: what comes first in the model's context first."""
    if "messages" in body:
        parts = []
        if body.get("tools"):
            parts.append("<|tools|>" + json.dumps(body["tools"], sort_keys=True))
        messages = body["messages"]
        for m in messages if isinstance(messages, list) else [messages]:
            if isinstance(m, dict):
                parts.append(f"<|{m.get('role')}|>{_content(m.get('content'))}"
                             f"{_content(m.get('tool_calls'))}<|end|>")
            else:
                parts.append(_content(m))
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\x00".join(prompt)
    return _content(prompt)


def _content(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    return json.dumps(value, sort_keys=True)


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

    def _trim(self, server: str) -> None:
        lru = self._lru.get(server)
        if lru is None:
            return
        cap = self.capacity(server)
        while len(lru) > cap:
            lru.popitem(last=False)
