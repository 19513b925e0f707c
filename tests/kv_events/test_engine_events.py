"""An engine with --kv-events-config in this process: a subscriber on 127.0.0.1 rebuilds its
prefix cache (both KV-cache groups of the tiny hybrid model) exactly, through sharing,
eviction, a reset and a late join by replay, with and without async scheduling."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("zmq")

from kvrelay import LLM, SamplingParams
from kvrelay.kv_cache.hashing import hash_blocks
from kvrelay.kv_events.wire import external_hash
from kvrelay.proxy.kv_events import KVEventSubscriber
from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
from tests.kv_events.test_publisher import settle
from tests.processes import free_port

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def cached(llm: LLM) -> set:
    return {(g, external_hash(h)) for (g, h) in llm.engine.kv.pool.cached}


def leading_cached(llm: LLM, prompt: list[int]) -> int:
    kv = llm.engine.kv
    n = 0
    for h in hash_blocks(prompt, kv.block_size, parent=kv.root):
        if kv.pool.lookup(0, h) is None:
            break
        n += 1
    return n


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_subscriber_rebuilds_the_engines_prefix_cache(tiny, async_scheduling):  # noqa: F811
    pub, replay = free_port(), free_port()
    topic = "kv@engine-0@tiny"
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=64, block_size=4,
              num_gpu_blocks_override=40, async_scheduling=async_scheduling,
              kv_events_config={"enable_kv_cache_events": True, "topic": topic,
                                "endpoint": f"tcp://127.0.0.1:{pub}",
                                "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
    publisher = llm.engine.kv_events
    assert len(llm.engine.kv.groups) == 2                # full attention + sliding window
    subs = [KVEventSubscriber("kv@", idle_replay_s=0.2)]
    subs[0].add_backend("tiny", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", bind=True)
    rng = random.Random(3)
    try:
        def check(sub: KVEventSubscriber, prompts=()):
            settle(publisher, sub, "tiny")
            assert sub.blocks("tiny") == cached(llm)
            for p in prompts:
                assert sub.cached_prefix_blocks("tiny", p) == leading_cached(llm, p)

        system = [rng.randrange(4, 160) for _ in range(13)]
        prompts = [system + [rng.randrange(4, 160) for _ in range(rng.randrange(1, 12))]
                   for _ in range(6)]
        llm.generate(prompts[:3], GREEDY)
        check(subs[0], prompts)
        assert {g for g, _ in subs[0].blocks("tiny")} == {0, 1}
        llm.generate(prompts[3:], GREEDY)
        check(subs[0], prompts)

        first = set(cached(llm))                           # 40 blocks: these get evicted
        for _ in range(4):
            llm.generate([[rng.randrange(4, 160) for _ in range(30)] for _ in range(3)], GREEDY)
            check(subs[0])
        assert first - cached(llm), "nothing was evicted"
        check(subs[0], prompts)

        assert llm.reset_prefix_cache()
        check(subs[0])
        assert subs[0].blocks("tiny") == set()
        llm.generate(prompts[:2], GREEDY)
        check(subs[0], prompts)

        subs[0].close()                    # a subscriber joining late: the replay alone
        subs.append(KVEventSubscriber("kv@", idle_replay_s=0.2))       # rebuilds the view
        subs[1].add_backend("tiny", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                            bind=True)
        check(subs[1], prompts)
        assert subs[1].view("tiny").stats.lost == 0
        assert publisher.dropped == 0
    finally:
        for sub in subs:
            sub.close()
        llm.engine.assert_no_leaks()
        llm.shutdown()
