"""The router's pure parts: prompt keys, the prefix table, server choice, the disagg policy."""
from __future__ import annotations

import struct
import time

import pytest

from kvrelay.proxy import scrape
from kvrelay.proxy.policy import DisaggPolicy, Router, hit_correction
from kvrelay.proxy.prefix import (
    HashChain,
    Hasher,
    PrefixTable,
    PromptKey,
    chain_hash,
    chain_root,
    render,
)
from kvrelay.proxy.routing import Backend
from tests.proxy.fakes import vllm_metrics

H = Hasher(block_size=4, chars_per_token=2.0)         # text chunks of 8 characters


def servers(n: int, role: str = "prefill") -> list[Backend]:
    return [Backend(role, "127.0.0.1", 8100 + i) for i in range(n)]


def key(text: str) -> PromptKey:
    return H.key("/v1/completions", {"model": "m", "prompt": text})


# ------------------------------------------------------------------ prompt keys

def test_token_id_prompts_use_the_servers_chained_hashes():
    ids = list(range(10))
    k = H.key("/v1/completions", {"model": "m", "prompt": ids})
    first = chain_hash(chain_root("ids:m"), struct.pack("<4q", *ids[:4]))
    assert k.hashes == [first, chain_hash(first, struct.pack("<4q", *ids[4:8]))]  # full blocks
    assert len(k.hashes) == 2 and k.tokens == 10 and k.cached_tokens(1) == 4


def test_text_prompts_hash_in_block_sized_character_chunks():
    k = key("a" * 8 + "b" * 8 + "c" * 5)
    assert len(k.hashes) == 2 and k.tokens == 11               # ceil(21 chars / 2)
    assert key("a" * 8 + "b" * 8 + "zzzzz").hashes == k.hashes  # partial chunk not hashed
    assert key("a" * 8 + "X" * 8).hashes[0] == k.hashes[0]
    assert key("a" * 8 + "X" * 8).hashes[1] != k.hashes[1]
    other = H.key("/v1/completions", {"model": "other", "prompt": "a" * 16})
    assert other.hashes[0] != k.hashes[0]                       # models never share entries


def test_a_chat_continuation_extends_its_conversations_key():
    turn1 = [{"role": "system", "content": "be brief " * 4},
             {"role": "user", "content": "hello " * 5}]
    turn2 = turn1 + [{"role": "assistant", "content": "hi " * 6},
                     {"role": "user", "content": "more"}]
    k1 = H.key("/v1/chat/completions", {"model": "m", "messages": turn1})
    k2 = H.key("/v1/chat/completions", {"model": "m", "messages": turn2})
    assert len(k2.hashes) > len(k1.hashes) >= 5
    assert k2.hashes[:len(k1.hashes)] == k1.hashes
    parts = [{"type": "text", "text": "hello " * 5}]
    assert render({"messages": [{"role": "user", "content": parts}]}) == \
        render({"messages": [{"role": "user", "content": "hello " * 5}]})


# ------------------------------------------------------------------ the table

def test_longest_prefix_per_server():
    t = PrefixTable()
    long, short = key("x" * 40).hashes, key("x" * 16 + "y" * 24).hashes
    t.record(long, "A")
    t.record(short, "B")
    assert t.match(long, ["A", "B", "C"]) == {"A": 5, "B": 2, "C": 0}
    assert t.match(short, ["A", "B"]) == {"A": 2, "B": 5}


def test_capacity_evicts_least_recent_tails_first():
    t = PrefixTable(default_capacity=6)
    old, new = key("o" * 32).hashes, key("n" * 32).hashes       # 4 blocks each
    t.record(old, "A")
    t.record(new, "A")
    assert t.blocks("A") == 6
    assert t.match(new, ["A"]) == {"A": 4}
    assert t.match(old, ["A"]) == {"A": 2}                      # its head survives, tail gone
    t.set_capacity("A", 3)                                      # /metrics: a smaller KV pool
    assert t.blocks("A") == 3 and t.match(new, ["A"]) == {"A": 3}


def test_forget_drops_one_server_only():
    t = PrefixTable()
    k = key("z" * 24).hashes
    t.record(k, "A")
    t.record(k, "B")
    assert t.forget("A") == 3 and t.forget("A") == 0
    assert t.match(k, ["A", "B"]) == {"A": 0, "B": 3}


# ------------------------------------------------------------------ choosing a server

def test_cache_hit_goes_to_the_longest_prefix():
    a, b, c = bs = servers(3)
    r = Router(bs)
    k = key("p" * 40)
    r.record(key("p" * 24), a)
    r.record(k, b)
    choice = r.choose(k)
    assert choice.decision == "cache_hit" and choice.order[0] is b
    assert choice.matched == {a.name: 3, b.name: 5, c.name: 0}
    assert sorted(x.name for x in choice.order) == sorted(x.name for x in bs)   # all still tried


def test_load_override_beyond_the_margin():
    a, b = bs = servers(2)
    r = Router(bs, load_margin=2)
    k = key("q" * 40)
    r.record(k, a)
    a.in_flight = 2                             # 2 - 0 <= margin: the cache still wins
    assert (r.choose(k).decision, r.choose(k).order[0]) == ("cache_hit", a)
    a.in_flight = 3                             # 3 - 0 > margin: the least loaded
    choice = r.choose(k)
    assert (choice.decision, choice.order[0]) == ("load_override", b)


def test_reported_load_counts_when_fresh():
    a, _b = bs = servers(2)
    r = Router(bs, load_margin=1)
    k = key("r" * 40)
    r.record(k, a)
    scrape.apply(a, scrape.parse(vllm_metrics(running=2, waiting=3)))   # others' traffic
    assert r.choose(k).decision == "load_override"
    a.reported_at = time.monotonic() - 60                               # stale: ignored
    assert r.choose(k).decision == "cache_hit"


def test_no_match_is_least_loaded_then_rotation():
    a, b, c = bs = servers(3)
    r = Router(bs)
    a.in_flight = 1
    firsts = [r.choose(key("s" * 40)).order[0] for _ in range(4)]
    assert a not in firsts and set(firsts) == {b, c}
    assert r.choose(key("s" * 40)).decision == "least_loaded"


def test_unhealthy_and_full_servers_lose_their_cache_advantage():
    a, b = bs = servers(2, "decode")
    r = Router(bs)
    k = key("u" * 40)
    r.record(k, a)
    a.healthy = False
    assert r.choose(k).order == [b, a]
    a.healthy, a.kv_usage = True, 0.97          # KV nearly full: tried after the others
    assert r.choose(k).order[0] is b


def test_restart_detected_from_counters_going_backwards():
    a = servers(1)[0]
    assert not scrape.apply(a, scrape.parse(vllm_metrics(queries=100, hits=40)))
    assert not scrape.apply(a, scrape.parse(vllm_metrics(queries=150, hits=60)))
    assert scrape.apply(a, scrape.parse(vllm_metrics(queries=8, hits=0)))


def test_round_robin_and_least_loaded_ignore_the_cache():
    a, b = bs = servers(2)
    k = key("v" * 40)
    rr = Router(bs, policy="round_robin")
    rr.table.record(k.hashes, a.name)
    assert [rr.choose(k).order[0] for _ in range(4)] == [a, b, a, b]
    ll = Router(bs, policy="least_loaded")
    ll.table.record(k.hashes, a.name)
    a.in_flight = 1
    assert {ll.choose(k).order[0] for _ in range(3)} == {b}


# ------------------------------------------------------------------ disaggregate or not

@pytest.mark.parametrize("tokens, cached_blocks, want", [
    (64, 0, True),           # short: uncached 64 <= 64
    (65, 0, False),          # one token more: prefill then decode
    (400, 84, True),         # 400 - 336 cached = 64 uncached
    (1000, 200, True),       # 800 of 1000 cached: >= 0.8
    (1000, 199, False),      # 796 of 1000, 204 uncached
])
def test_auto_thresholds(tokens, cached_blocks, want):
    k = PromptKey([b"h"] * (tokens // 4), tokens, 4.0)
    direct, why = DisaggPolicy("auto", 64, 0.8).direct(k, cached_blocks)
    assert direct is want, why


def test_always_and_never():
    k = PromptKey([], 3, 4.0)
    assert DisaggPolicy("always").direct(k, 0)[0] is False
    assert DisaggPolicy("never").direct(PromptKey([b"h"] * 500, 2000, 4.0), 0)[0] is True


def test_hit_correction_drops_what_the_server_did_not_hit():
    a = servers(1)[0]
    scrape.apply(a, scrape.parse(vllm_metrics(queries=100, hits=50)))
    assert hit_correction(a) is None                    # the window starts
    a.expected_hits = 400                               # not enough expected yet
    assert hit_correction(a) is None
    a.expected_hits = 1000
    scrape.apply(a, scrape.parse(vllm_metrics(queries=1200, hits=50 + 800)))
    assert hit_correction(a) is None                    # 800 of 1000 hit: fine; new window
    a.expected_hits = 2000
    scrape.apply(a, scrape.parse(vllm_metrics(queries=2400, hits=850 + 250)))
    assert hit_correction(a) == pytest.approx(0.75)     # 250 of 1000: drop 3/4


def test_evict_drops_the_oldest():
    t = PrefixTable()
    old, new = key("o" * 32).hashes, key("n" * 32).hashes
    t.record(old, "A")
    t.record(new, "A")
    assert t.evict("A", 5) == 5 and t.blocks("A") == 3
    assert t.match(new, ["A"]) == {"A": 3} and t.match(old, ["A"]) == {"A": 0}
    assert t.evict("B", 2) == 0


def test_only_a_bounded_head_is_hashed():
    from kvrelay.proxy.prefix import MAX_KEY_BLOCKS
    k = H.key("/v1/completions",
              {"model": "m", "prompt": "y" * (H.chunk_chars * MAX_KEY_BLOCKS * 3)})
    assert len(k.hashes) == MAX_KEY_BLOCKS and k.tokens == H.chunk_chars * MAX_KEY_BLOCKS * 3 // 2


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2 ** 70, 3] * 8}, {"prompt": [True, 2]}, {"prompt": {"a": 1}}, {"prompt": None},
    {"prompt": [[1, 2], "x"]}, {"messages": 7}, {"messages": "hi" * 40}, {"messages": [None, 3]},
    {"messages": [{"role": "user", "content": {"odd": [1]}}]}, {},
])
def test_malformed_bodies_still_get_a_key(body):
    """The server judges a bad request (and answers 400); the router must not fail first."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    k = H.key(path, body)
    assert k.tokens >= 0 and isinstance(k.hashes, HashChain)


def test_small_kv_usage_differences_keep_the_rotation():
    a, b = bs = servers(2)
    a.kv_usage, b.kv_usage = 0.03, 0.01            # cached/held blocks: a little different
    r = Router(bs, policy="least_loaded")
    assert [r.choose(None).order[0] for _ in range(4)] == [a, b, a, b]
    a.kv_usage = 0.35                              # a 10 % step fuller: b first
    assert {r.choose(None).order[0] for _ in range(3)} == {b}
