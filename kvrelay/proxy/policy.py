"""How the proxy picks a prefill server, a decode server, and whether to disaggregate at all.

Pure bookkeeping (no I/O), unit-tested with exact values.

Server choice (`--routing`):
- `round_robin`: each request starts one server further along.
- `least_loaded`: the fewest requests in flight (or running + waiting, as the server's
  /metrics last said, when that is more), ties round-robin.
- `cache_aware` (default): the server holding the longest prefix of the prompt
  (`PrefixTable`, the proxy's guess from what it routed; with `--kv-events-port` a
  server's own KV events where they are live, `Router.events`), unless its load exceeds
  the least-loaded server's by more than `load_margin` requests — then the least-loaded
  one ("load override"). No server holding any of it: least-loaded.
Always: servers cooling down (a failed /health probe or connection) go last; a decode
server whose KV cache is nearly full (`KV_FULL`) goes after the others. A router orders the
servers that take requests (`Router.backends`, which `ProxyState` replaces as servers are
admitted and drained); with none, its choice is empty ("no_server").

Disaggregation (`--disagg-policy`):
- `always`: prefill → decode (the tutorial's flow).
- `never`: every request straight to a decode server, which prefills it itself.
- `auto`: straight to decode when the prompt's part the chosen decode server does not hold
  is at most `direct_max_tokens`, or when it holds at least `direct_cached_fraction` of
  the prompt; else prefill → decode. A KV transfer and a second hop cost more than
  prefilling a few tokens where they will be decoded.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.proxy.prefix import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_SERVER_BLOCKS,
    CachedPrefixes,
    Hasher,
    PrefixTable,
    PromptKey,
)
from kvrelay.proxy.routing import Backend

if TYPE_CHECKING:
    from kvrelay.proxy.kv_events_feed import KVEventsRouting

ROUTING_POLICIES = ("cache_aware", "round_robin", "least_loaded")
DISAGG_POLICIES = ("always", "auto", "never")
DEFAULT_LOAD_MARGIN = 2
# Measured (benchmarks/routing.py --part crossover, docs/benchmarks.md): the hand-off (prefill
# round trip, KV transfer, second hop) cost 1.48 s and the decode server prefilled 57.5 tok/s,
# so a prompt of up to 1.48 x 57.5 = 85 tokens prefills on the decode server in no more time
# than the hand-off alone; rounded up to whole 16-token blocks.
DEFAULT_DIRECT_MAX_TOKENS = 96
DEFAULT_DIRECT_CACHED_FRACTION = 0.8
KV_FULL = 0.95                     # a decode server this full is tried after the others
KV_USAGE_STEPS = 10                # equal loads: a server a 10 % step emptier goes first


def load(b: Backend) -> float:
    """Requests on the server: what this proxy has in flight there, or what the server last
    reported running and waiting (other clients included) when that is more."""
    return max(float(b.in_flight), b.reported_load())


@dataclass
class Choice:
    """The servers to try, first choice first, and why the first was chosen."""

    order: list[Backend]
    decision: str                  # cache_hit | load_override | least_loaded | round_robin
                                   # | no_server (nothing to order)
    matched: dict[str, int] = field(default_factory=dict)    # server → leading blocks held

    @property
    def first_matched(self) -> int:
        return self.matched.get(self.order[0].name, 0) if self.order else 0


@dataclass
class Router:
    """Orders one role's servers for a request (see the module docstring)."""

    backends: list[Backend]
    policy: str = "cache_aware"
    load_margin: float = DEFAULT_LOAD_MARGIN
    table: PrefixTable = field(default_factory=PrefixTable)
    events: CachedPrefixes | None = None      # the servers' KV events (proxy/kv_events.py)
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    def _rotation(self) -> dict[str, int]:
        start = next(self._counter) % len(self.backends)
        n = len(self.backends)
        return {b.name: (i - start) % n for i, b in enumerate(self.backends)}

    def _least_loaded(self, rotation: dict[str, int], now: float) -> list[Backend]:
        # KV usage breaks load ties only in coarse steps: any two servers differ a little
        # (cached and held blocks), and an exact comparison would end the rotation.
        return sorted(self.backends, key=lambda b: (b.cooling(now), b.kv_usage >= KV_FULL, load(b),
                                                    int(b.kv_usage * KV_USAGE_STEPS),
                                                    rotation[b.name]))

    def choose(self, key: PromptKey | None) -> Choice:
        if not self.backends:
            return Choice([], "no_server")
        now = time.monotonic()
        rotation = self._rotation()
        if self.policy == "round_robin":
            order = sorted(self.backends, key=lambda b: (b.cooling(now), rotation[b.name]))
            return Choice(order, "round_robin")
        ranked = self._least_loaded(rotation, now)
        if self.policy == "least_loaded" or key is None or not key.hashes:
            return Choice(ranked, "least_loaded")
        matched = self.table.match(key.hashes, (b.name for b in self.backends))
        if self.events is not None:
            matched = self.events.refine(key, matched)
        usable = [b for b in ranked if not b.cooling(now) and b.kv_usage < KV_FULL] or ranked[:1]
        best = max(usable, key=lambda b: (matched[b.name], -load(b), -rotation[b.name]))
        if matched[best.name] == 0:
            return Choice(ranked, "least_loaded", matched)
        if load(best) - load(usable[0]) > self.load_margin:
            return Choice(ranked, "load_override", matched)
        return Choice([best] + [b for b in ranked if b is not best], "cache_hit", matched)

    def record(self, key: PromptKey | None, backend: Backend) -> None:
        if key is not None and key.hashes and self.policy == "cache_aware":
            self.table.record(key.hashes, backend.name)

    def forget(self, backend: Backend) -> int:
        return self.table.forget(backend.name)

    def drop(self, backend: Backend) -> None:
        """`backend` is gone for good: its entries and its capacity."""
        self.table.drop(backend.name)


# Hit-rate correction: once the router has expected at least this many prefix-cache hit
# tokens on a server since the last check, it compares them with the hits the server
# reported; a server that hit less than HIT_SHORTFALL of them evicted what the router
# thinks it holds, and the router drops the same share of its oldest entries for it.
HIT_CHECK_TOKENS = 512
HIT_SHORTFALL = 0.5


def hit_correction(backend: Backend) -> float | None:
    """The share of `backend`'s table entries to drop (None: nothing to correct yet), from
    its expected vs reported prefix-cache hits since the window began; starts a new window
    once enough was expected."""
    now = (backend.expected_hits, backend.prefix_hits)
    if backend.window_start is None:
        backend.window_start = now
        return None
    expected = now[0] - backend.window_start[0]
    if expected < HIT_CHECK_TOKENS:
        return None
    reported = max(0.0, now[1] - backend.window_start[1])
    backend.window_start = now
    ratio = reported / expected
    return None if ratio >= HIT_SHORTFALL else 1.0 - ratio


@dataclass(frozen=True)
class DisaggPolicy:
    policy: str = "always"
    direct_max_tokens: int = DEFAULT_DIRECT_MAX_TOKENS
    direct_cached_fraction: float = DEFAULT_DIRECT_CACHED_FRACTION

    def direct(self, key: PromptKey | None, decode_blocks: int) -> tuple[bool, str]:
        """(straight to decode?, why) for a prompt of which the chosen decode server holds
        `decode_blocks` leading blocks."""
        if self.policy == "never":
            return True, "policy never"
        if self.policy == "always" or key is None:
            return False, "policy always"
        cached = key.cached_tokens(decode_blocks)
        uncached = key.tokens - cached
        if uncached <= self.direct_max_tokens:
            return True, f"{uncached} uncached tokens <= {self.direct_max_tokens}"
        if key.tokens and cached / key.tokens >= self.direct_cached_fraction:
            return True, (f"decode holds {cached}/{key.tokens} tokens "
                          f">= {self.direct_cached_fraction:g}")
        return False, f"{uncached} uncached tokens > {self.direct_max_tokens}"


@dataclass(frozen=True)
class RoutingSettings:
    """The proxy's routing flags (`kvrelay proxy --help`)."""

    routing: str = "cache_aware"
    load_margin: float = DEFAULT_LOAD_MARGIN
    disagg: DisaggPolicy = field(default_factory=DisaggPolicy)
    block_size: int = DEFAULT_BLOCK_SIZE
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    table_blocks: int = DEFAULT_SERVER_BLOCKS
    kv_events: KVEventsRouting | None = None     # --kv-events-port: follow prefills' events

    def hasher(self, token_keys: bool | None = None) -> Hasher:
        """`token_keys`: key token-id prompts for KV events too (default: when followed)."""
        if token_keys is None:
            token_keys = self.kv_events is not None
        return Hasher(self.block_size, self.chars_per_token, token_keys)

    def router(self, backends: list[Backend], role: str) -> Router:
        """Decode servers are never plain round-robin: a decode request lasts its whole
        generation, so under `round_robin` they stay least-loaded (the tutorial's proxy)."""
        round_robin_decode = role == "decode" and self.routing == "round_robin"
        policy = "least_loaded" if round_robin_decode else self.routing
        return Router(backends, policy, self.load_margin, PrefixTable(self.table_blocks))
