"""Block pool, hashing, sliding-window release and prefix-hit rules."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.kv_cache.block_pool import NULL_BLOCK, BlockPool, OutOfBlocks
from kvrelay.kv_cache.hashing import hash_blocks, root_hash
from kvrelay.kv_cache.manager import KVCacheGroup, KVCacheManager

FULL = KVCacheGroup(window=None, num_layers=1)


def make_manager(num_blocks=32, block_size=4, window=None, hybrid=False, caching=True):
    groups = [FULL] + ([KVCacheGroup(window=window, num_layers=1)] if hybrid else [])
    if window and not hybrid:
        groups = [KVCacheGroup(window=window, num_layers=1)]
    return KVCacheManager(num_blocks, block_size, groups, enable_prefix_caching=caching)


def run_prompt(m: KVCacheManager, req: str, tokens: list[int], use_hit=True) -> int:
    hit = m.find_prefix_hit(req, tokens) if use_hit else None
    start = hit.num_tokens if hit else 0
    assert m.allocate(req, start, len(tokens), hit)
    m.cache_blocks(req, tokens, len(tokens))
    return start


# -- hashing ---------------------------------------------------------------------------
def test_hashes_chain_and_only_cover_full_blocks():
    a = hash_blocks(list(range(10)), 4)
    b = hash_blocks(list(range(8)) + [99, 98, 97], 4)
    assert len(a) == 2 and a == b                       # the partial third block is not hashed
    c = hash_blocks([1] + list(range(1, 8)), 4)
    assert c[0] != a[0] and c[1] != a[1]                # a change in block 0 changes block 1's hash
    assert hash_blocks(list(range(8)), 4, parent=root_hash("other-model")) != a


def test_hashes_are_stable_across_processes():
    code = ("from kvrelay.kv_cache.hashing import hash_blocks;"
            "print(hash_blocks(list(range(12)), 4)[-1].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert other == hash_blocks(list(range(12)), 4)[-1].hex()


# -- pool ------------------------------------------------------------------------------
def test_pool_lru_eviction_and_revival():
    pool = BlockPool(4)                                 # blocks 1..3 usable
    a, b, c = pool.allocate(3)
    pool.cache(a, 0, b"ha")
    pool.cache(b, 0, b"hb")
    pool.release([b, a, c])                             # free queue order: b, a, c
    assert pool.num_free == 3
    assert pool.lookup(0, b"ha") is a
    pool.touch([a])                                     # prefix hit revives a
    assert pool.num_free == 2 and a.ref_cnt == 1
    (x,) = pool.allocate(1)                             # LRU head is b: its hash is evicted
    assert x is b and pool.lookup(0, b"hb") is None and b.block_hash is None
    pool.check_integrity()
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(3)
    assert NULL_BLOCK not in [b.block_id for b in pool.allocate(2)]


def test_integrity_check_catches_double_free():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(AssertionError, match="released with ref_cnt 0"):
        pool.release([a])


# -- full attention prefix hits -------------------------------------------------------
def test_full_attention_hit_never_covers_last_prompt_token():
    m = make_manager()
    prompt = list(range(12))                            # exactly 3 blocks
    assert run_prompt(m, "a", prompt) == 0
    hit = m.find_prefix_hit("b", prompt)
    assert hit.num_tokens == 8                          # not 12: token 11 must be computed
    assert m.find_prefix_hit("c", prompt + [50]).num_tokens == 12
    m.free("a")
    m.free("b")
    m.free("c")
    m.assert_no_leaks()


def test_hit_shares_blocks_and_counts_stats():
    m = make_manager()
    run_prompt(m, "a", list(range(10)))
    run_prompt(m, "b", list(range(8)) + [70, 71, 72])
    assert m.block_ids("a")[0][:2] == m.block_ids("b")[0][:2]
    assert m.block_ids("a")[0][2] != m.block_ids("b")[0][2]
    assert (m.stats.queries, m.stats.hits) == (21, 8)
    assert m.pool.blocks[m.block_ids("a")[0][0]].ref_cnt == 2
    m.check_integrity()
    m.free("a")
    m.free("b")
    m.assert_no_leaks()


def test_prefix_caching_off_never_hits():
    m = make_manager(caching=False)
    run_prompt(m, "a", list(range(10)))
    assert m.find_prefix_hit("b", list(range(10))).num_tokens == 0


def test_allocation_is_all_or_nothing_and_counts_revived_blocks():
    m = make_manager(num_blocks=5)                      # 4 usable
    run_prompt(m, "a", list(range(12)))                 # 3 blocks
    m.free("a")                                         # cached, free
    hit = m.find_prefix_hit("b", list(range(16)) + [1])
    assert hit.num_tokens == 12
    # 3 revived + 2 new > 4 free: refused, nothing changed
    assert not m.allocate("b", 12, 20, hit)
    assert m.pool.num_free == 4
    assert m.allocate("b", 12, 16, hit)                 # 3 revived + 1 new
    m.free("b")
    m.assert_no_leaks()


# -- sliding window -------------------------------------------------------------------
def test_sliding_window_releases_blocks_that_left_the_window():
    """W=8, B=4. After 14 tokens the next query (position 14) sees keys 7..14:
    positions 0-3 (block 0) are no longer needed; block 1 (4-7) still is."""
    m = make_manager(window=8)
    tokens = list(range(14))
    assert m.allocate("a", 0, 14)
    assert m.num_blocks_held("a") == 4
    assert m.allocate("a", 14, 15)
    ids = m.block_ids("a")[0]
    assert ids[0] == NULL_BLOCK and NULL_BLOCK not in ids[1:]
    assert m.num_blocks_held("a") == 3
    assert m.allocate("a", 16, 17)                      # query 16 sees 9..16: block 1 (4-7) goes
    assert m.block_ids("a")[0][:2] == [NULL_BLOCK, NULL_BLOCK]
    assert len(tokens) == 14
    m.free("a")
    m.assert_no_leaks()


@pytest.mark.parametrize("window,cached,expected", [
    # B=4, W=8: a hit of L blocks needs the blocks holding positions [4L-7, 4L):
    #   L:      1     2     3     4     5
    #   needs: [0]  [0,1] [1,2] [2,3] [3,4]
    (8, [1, 1, 1, 1, 1], 5),
    (8, [0, 0, 0, 1, 1], 5),
    (8, [1, 1, 0, 1, 0], 2),
    (8, [1, 0, 1, 0, 1], 1),
    (8, [0, 1, 1, 1, 0], 4),
    # W=5: positions [4L-4, 4L) — only block L-1
    (5, [0, 0, 0, 1, 0], 4),
])
def test_sliding_window_hit_rule(window, cached, expected):
    B = 4
    m = make_manager(block_size=B, window=window)
    tokens = list(range(len(cached) * B + 1))
    hashes = hash_blocks(tokens, B)
    blocks = m.pool.allocate(len(cached))
    for i, (flag, block) in enumerate(zip(cached, blocks)):
        if flag:
            m.pool.cache(block, 0, hashes[i])
    m.pool.release(blocks)
    assert m.find_prefix_hit("r", tokens).num_tokens == expected * B


def test_hybrid_hit_is_limited_by_both_groups():
    m = make_manager(window=8, hybrid=True)
    prompt = list(range(21))
    run_prompt(m, "a", prompt)
    m.free("a")
    # full group still has all 5 blocks cached; evict the sliding group's block 4
    block4 = m.pool.lookup(1, hash_blocks(prompt, 4)[4])
    m.pool._uncache(block4)
    hit = m.find_prefix_hit("b", prompt)
    # L=5 needs sliding blocks 3,4; 4 is gone → L=4 needs blocks 2,3 (positions 9..15): ok
    assert hit.num_tokens == 16
    assert [b.block_id for b in hit.blocks[1][:2]] == [NULL_BLOCK, NULL_BLOCK]
    assert m.allocate("b", 16, 21, hit)
    m.check_integrity()
    m.free("b")
    m.assert_no_leaks()


def test_compat_hash_names_what_differs():
    from kvrelay.kv_cache.spec import KVCacheSpec
    a = KVCacheSpec("gpt-oss-20b:abc", "bfloat16", 16, 24, 8, 64, True, 128)
    b = KVCacheSpec("gpt-oss-20b:abc", "bfloat16", 32, 24, 8, 64, False, 128)
    assert a.compat_hash() == KVCacheSpec(**a.__dict__).compat_hash()
    assert a.compat_hash() != b.compat_hash()
    assert a.differences(b) == ["block_size: 16 vs 32", "hybrid: True vs False"]


# -- allocate's no-op fast path -----------------------------------------------------------
def _state_of(m: KVCacheManager) -> tuple:
    tables = {r: m.block_ids(r) for r in sorted(m.requests)}
    return tables, m.pool.num_free, [b.ref_cnt for b in m.pool.blocks]


@pytest.mark.parametrize("window,hybrid", [(None, False), (6, False), (9, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_allocate_fast_path_keeps_block_accounting(window, hybrid, seed):
    """Decode steps, prefix hits, pool exhaustion and preemption (free, then a fresh
    allocation) leave the same tables, free counts and ref counts as allocate without
    its early exit; the early exit does take most decode steps."""
    import random
    rng = random.Random(seed)
    fast = make_manager(num_blocks=24, window=window, hybrid=hybrid)
    slow = make_manager(num_blocks=24, window=window, hybrid=hybrid)
    slow._set_fits = lambda state, num_computed: None      # type: ignore[method-assign]
    full_calls = 0
    real_skip = fast._skip_out_of_window

    def counting_skip(state, num_computed):
        nonlocal full_calls
        full_calls += 1
        real_skip(state, num_computed)
    fast._skip_out_of_window = counting_skip                # type: ignore[method-assign]
    prefixes = [[rng.randrange(50) for _ in range(9)] for _ in range(2)]
    running: dict[str, list[int]] = {}                      # request -> its tokens
    computed: dict[str, int] = {}
    calls = 0
    for step in range(400):
        if len(running) < 3 and rng.random() < 0.3:
            req = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            hits = [m.find_prefix_hit(req, tokens) for m in (fast, slow)]
            assert hits[0].num_tokens == hits[1].num_tokens
            ok = [m.allocate(req, h.num_tokens, len(tokens), h) for m, h in zip((fast, slow), hits)]
            assert ok[0] == ok[1]
            if ok[0]:
                running[req], computed[req] = tokens, len(tokens)
                for m in (fast, slow):
                    m.cache_blocks(req, tokens, len(tokens))
            else:
                for m in (fast, slow):
                    m.free(req)
        for req in list(running):
            n = computed[req]
            ok = [m.allocate(req, n, n + 1) for m in (fast, slow)]
            calls += 1
            assert ok[0] == ok[1], (step, req)
            if not ok[0] or rng.random() < 0.02:            # preempted, or finished
                for m in (fast, slow):
                    m.free(req)
                del running[req], computed[req]
                continue
            running[req].append(rng.randrange(50))
            computed[req] = n + 1
            for m in (fast, slow):
                m.cache_blocks(req, running[req], n + 1)
        assert _state_of(fast) == _state_of(slow), step
        fast.check_integrity()
    # a decode needs work when it crosses a block boundary, and (window groups) when a
    # block leaves the window: 1 and 2 steps in block_size (4) here, plus new prompts
    assert calls > 300 and full_calls < calls * (0.35 if window is None else 0.6)
    for req in list(running):
        for m in (fast, slow):
            m.free(req)
    fast.assert_no_leaks()
    slow.assert_no_leaks()


def test_block_ids_follow_every_table_change_and_earlier_answers_stay_put():
    """`block_ids` is built once per change of a request's tables (allocating past a
    block, releasing sliding-window blocks, a prefix hit), never modified in place."""
    m = make_manager(num_blocks=32, block_size=4, window=6, hybrid=True, caching=False)
    assert m.allocate("a", 0, 6)
    first = m.block_ids("a")
    assert m.block_ids("a") is first                     # nothing changed: the same answer
    snapshot = [list(t) for t in first]
    assert m.allocate("a", 6, 7) and m.block_ids("a") is first       # still in block 1
    assert m.allocate("a", 7, 9)                                      # block 2 appended
    grown = m.block_ids("a")
    assert first == snapshot and grown is not first
    assert [len(t) for t in grown] == [3, 3]
    for n in range(9, 15):                                # the window slides past block 0
        assert m.allocate("a", n, n + 1)
    slid = m.block_ids("a")
    assert slid[1][0] == NULL_BLOCK and slid[0][0] != NULL_BLOCK
    assert grown[1][0] != NULL_BLOCK                      # the earlier answer kept its ids
    assert slid == [[b.block_id for b in t] for t in m.requests["a"].tables]
    m.free("a")
    assert m.allocate("a", 0, 2)
    assert m.block_ids("a") == [[t[0].block_id] for t in m.requests["a"].tables]
