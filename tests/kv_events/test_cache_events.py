"""The prefix cache's record of its own changes (kv_cache/events.py): replaying the events
rebuilds exactly the pool's cache map, through sharing, sliding-window gaps, eviction and
resets; nothing is recorded when events are off."""
from __future__ import annotations

import random

from kvrelay.kv_cache.events import Cleared, Removed, Stored
from kvrelay.kv_cache.hashing import hash_blocks
from kvrelay.kv_cache.manager import KVCacheGroup, KVCacheManager

FULL, WINDOW = KVCacheGroup(None, 1), KVCacheGroup(8, 1)


def make(num_blocks=16, hybrid=False, events=True) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, [FULL, WINDOW] if hybrid else [FULL],
                          enable_kv_cache_events=events)


def run(m: KVCacheManager, req: str, tokens: list[int], free=True) -> None:
    hit = m.find_prefix_hit(req, tokens)
    assert m.allocate(req, hit.num_tokens, len(tokens), hit)
    m.cache_blocks(req, tokens, len(tokens))
    if free:
        m.free(req)


def apply(view: set, events: list) -> set:
    for e in events:
        if isinstance(e, Stored):
            assert len(e.token_ids) == 4 * len(e.hashes)
            view |= {(e.group, h) for h in e.hashes}
        elif isinstance(e, Removed):
            view.remove((e.group, e.block_hash))          # only what was stored is removed
        else:
            view.clear()
    return view


def test_a_prompt_is_one_stored_run_chained_from_the_root():
    m = make()
    tokens = list(range(10))
    run(m, "a", tokens)
    (event,) = m.take_events()
    hashes = hash_blocks(tokens, 4, parent=m.root)
    assert event == Stored(0, hashes, None, tokens[:8])
    assert m.take_events() == []                          # taken once
    run(m, "b", tokens + list(range(50, 56)))            # shares 2 blocks, adds 2 (16 tokens)
    (event,) = m.take_events()
    assert event.parent == hashes[1] and event.token_ids == list(range(8, 10)) + list(range(50, 56))
    assert event.hashes == hash_blocks(tokens + list(range(50, 56)), 4, parent=m.root)[2:]


def test_eviction_is_recorded_in_order_and_reset_clears():
    m = make(num_blocks=5)                                # 4 usable blocks
    run(m, "a", list(range(9)))                           # 3 blocks, 2 cached
    run(m, "b", list(range(100, 109)))                    # evicts a's
    events = m.take_events()
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("Removed") >= 1 and kinds[0] == "Stored" and kinds[-1] == "Stored"
    assert apply(set(), events) == set(m.pool.cached)
    run(m, "c", list(range(200, 205)), free=False)
    assert not m.reset_prefix_cache()                     # a request holds blocks: refused
    m.free("c")
    assert m.reset_prefix_cache() and not m.pool.cached
    assert isinstance(m.take_events()[-1], Cleared)


def test_sliding_window_nulls_are_skipped_and_the_view_stays_exact():
    """A table allocated at position 24 (a decode server loading a remote prefill's KV)
    holds null blocks below the window in the sliding group: its run starts after them,
    chained to the hash of the block before it (as vLLM's events are)."""
    m = make(num_blocks=40, hybrid=True)
    tokens = list(range(26))
    hashes = hash_blocks(tokens, 4, parent=m.root)
    assert m.allocate("a", 24, 26)
    assert m.block_ids("a")[1][:4] == [0, 0, 0, 0]       # window 8: blocks 0-3 out of sight
    m.cache_blocks("a", tokens, 24)
    full, window = m.take_events()
    assert full == Stored(0, hashes[:6], None, tokens[:24])
    assert window == Stored(1, hashes[4:6], hashes[3], tokens[16:24])
    m.free("a")
    assert apply(set(), [full, window]) == set(m.pool.cached)


def test_random_workload_rebuilds_the_cache_map_exactly():
    rng = random.Random(7)
    for hybrid in (False, True):
        m, view = make(num_blocks=24, hybrid=hybrid), set()
        prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
        for i in range(200):
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            run(m, f"r{i}", tokens[:40])
            if rng.random() < 0.02:
                assert m.reset_prefix_cache()
            view = apply(view, m.take_events())
            assert view == set(m.pool.cached)
        m.check_integrity()


def test_nothing_is_recorded_when_events_are_off():
    m = make(events=False)
    run(m, "a", list(range(12)))
    assert m.pool.events is None and m.take_events() == []
