"""`kvrelay serve --kv-events-config`: a subscriber on 127.0.0.1 (pyzmq SUB + a replay
DEALER, kvrelay/proxy/kv_events.py) rebuilds the server's cached block set from vLLM-format
events: the exact blocks of the prompts sent, then, after evictions, the server's own prefix
hits (vllm:prefix_cache_hits) are what the subscriber predicts for every prompt; a
subscriber joining late gets the same set by replay, and one that follows a restarted
server sees its cache start empty."""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

pytest.importorskip("zmq")

from kvrelay.proxy.kv_events import KVEventSubscriber
from kvrelay.proxy.kv_view import prefix_keys
from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
from tests.processes import Server, free_port

B = 4
HITS = "vllm:prefix_cache_hits_total"


def flags(pub: int, replay: int) -> list[str]:
    # one KV-cache group (no hybrid split): a prefix hit is the leading run of cached blocks
    config = {"enable_kv_cache_events": True, "topic": "kv@tiny-0@tiny",
              "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return ["--dtype", "float32", "--max-model-len", "64", "--block-size", str(B),
            "--num-gpu-blocks-override", "24", "--disable-hybrid-kv-cache-manager",
            "--served-model-name", "tiny", "--kv-events-config", json.dumps(config)]


def complete(server: Server, prompt: list[int]) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def drain(sub: KVEventSubscriber, quiet_s: float = 0.6, timeout: float = 20) -> None:
    """Until nothing but idle replays' end markers arrived for `quiet_s` and no replay is in
    flight (the server queued each batch before its answer went out; a batch lost on the
    way is fetched by the idle replay, every 0.2 s)."""
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet_s or any(
            b.replay_since is not None for b in sub._backends.values()):
        applied = sum(v.view.stats.batches for v in sub._backends.values())
        sub.poll(0.05)
        if sum(v.view.stats.batches for v in sub._backends.values()) != applied:
            quiet_since = time.monotonic()
        assert time.monotonic() < deadline, "events did not settle"


def keys(sub: KVEventSubscriber) -> set[bytes]:
    return {k for (_, k) in sub.view("tiny").keys}


def test_a_subscriber_rebuilds_the_servers_cached_blocks(tiny, tmp_path):  # noqa: F811
    pub, replay = free_port(), free_port()
    rng = random.Random(5)
    subs = [KVEventSubscriber("kv@", idle_replay_s=0.2)]
    subs[0].add_backend("tiny", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", bind=True)
    server = Server(str(tiny[0]), flags(pub, replay), tmp_path / "serve.log")
    try:
        server.wait_ready()
        drain(subs[0])             # the SUB socket takes in the server's connection
        # 1. no eviction yet (23 usable blocks): exactly the prompts' full blocks
        shared = [rng.randrange(4, 160) for _ in range(9)]
        prompts = [shared + [rng.randrange(4, 160) for _ in range(n)] for n in (3, 8, 11)]
        for p in prompts:
            complete(server, p)
        drain(subs[0])
        want = {k for p in prompts for k in prefix_keys(p, B)}
        assert keys(subs[0]) == want and len(subs[0].blocks("tiny")) == len(want)

        # 2. evictions; then every prompt's prefix hit is the one the events predict
        prompts += [[rng.randrange(4, 160) for _ in range(21)] for _ in range(5)]
        for p in prompts[3:]:
            complete(server, p)
        drain(subs[0])
        assert not want <= keys(subs[0]), "nothing was evicted"
        assert len(subs[0].blocks("tiny")) <= 23
        hits = server.metrics()[HITS]
        for p in prompts:
            predicted = min(subs[0].cached_prefix_blocks("tiny", p), (len(p) - 1) // B) * B
            complete(server, p)
            after = server.metrics()[HITS]
            assert after - hits == predicted, (p, predicted)
            hits = after
            drain(subs[0])
        assert subs[0].view("tiny").stats.lost == 0

        # 3. a subscriber joining now: the replay alone gives the same set
        final = subs[0].blocks("tiny")
        subs[0].close()
        subs.append(KVEventSubscriber("kv@", idle_replay_s=0.2))
        subs[1].add_backend("tiny", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                            bind=True)
        drain(subs[1])
        assert subs[1].blocks("tiny") == final and subs[1].view("tiny").stats.lost == 0
        batches = subs[1].view("tiny").next_seq

        # 4. the server restarts: its sequence starts again, its cache empty
        server.stop()
        server = Server(str(tiny[0]), flags(pub, replay), tmp_path / "serve2.log")
        server.wait_ready()
        complete(server, prompts[0])
        drain(subs[1])
        view = subs[1].view("tiny")
        assert view.stats.restarts == 1 and view.next_seq < batches
        assert keys(subs[1]) == set(prefix_keys(prompts[0], B))
    finally:
        for sub in subs:
            sub.close()
        server.stop()
