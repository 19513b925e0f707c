"""cache_aware routing from the prefill servers' KV events (`kvrelay proxy --kv-events-port`):
real publishers (the engine core's, in this process, on 127.0.0.1) scripted with the blocks
each server holds, the proxy's feed following them, and the router choosing by what the
events say instead of its own guess; a silent stream falls back to the guess. Then the flags,
and one e2e: 2 prefill + 1 decode `kvrelay serve` behind a proxy that follows their events."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

zmq = pytest.importorskip("zmq")

from kvrelay.kv_cache.events import Stored  # noqa: E402
from kvrelay.kv_events.config import KVEventsConfig  # noqa: E402
from kvrelay.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kvrelay.kv_events.wire import GroupSpec, WireFormat  # noqa: E402
from kvrelay.proxy import main as proxy_main  # noqa: E402
from kvrelay.proxy.body import parse_body  # noqa: E402
from kvrelay.proxy.kv_events_feed import EventSource, KVEventsFeed  # noqa: E402
from kvrelay.proxy.kv_view import prefix_keys  # noqa: E402
from kvrelay.proxy.policy import Router  # noqa: E402
from kvrelay.proxy.prefix import Hasher  # noqa: E402
from kvrelay.proxy.routing import Backend, EndpointError  # noqa: E402
from tests.engine.conftest import tiny  # noqa: E402,F401  (the tiny checkpoint, for the e2e)
from tests.processes import KvrelayProcess, free_port  # noqa: E402

B = 4
HASHER = Hasher(B, token_keys=True)
PROMPT = list(range(100, 113))                        # 3 full blocks of 4, and one token


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def stored(tokens: list[int], first: int) -> Stored:
    """`tokens`' full blocks entering the cache, under engine hashes h(first), h(first+1)…"""
    n = len(tokens) // B
    return Stored(0, [h(first + i) for i in range(n)], None, tokens[:n * B])


class Server:
    """One 'prefill server' for the router: a Backend and the publisher of its events."""

    def __init__(self, block_size: int = B) -> None:
        self.backend = Backend("prefill", "127.0.0.1", free_port())
        pub, replay = free_port(), free_port()
        self.source = EventSource(self.backend.name, f"tcp://127.0.0.1:{pub}",
                                  f"tcp://127.0.0.1:{replay}")
        self.publisher = ZmqEventPublisher(KVEventsConfig.from_json({
            "enable_kv_cache_events": True, "endpoint": self.source.endpoint, "bind": True,
            "replay_endpoint": self.source.replay_endpoint}),
            WireFormat(block_size, [GroupSpec.of_window(None)]))

    @property
    def name(self) -> str:
        return self.backend.name


@pytest.fixture
def servers():
    made = [Server(), Server()]
    yield made
    for s in made:
        s.publisher.shutdown()


def follow(servers: list[Server], stale_s: float = 1.0) -> tuple[KVEventsFeed, CollectorRegistry]:
    registry = CollectorRegistry()
    feed = KVEventsFeed([s.source for s in servers], B, stale_s=stale_s, idle_replay_s=0.2,
                        registry=registry)
    feed.start()
    return feed, registry


def wait_for(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def key(prompt: list[int]):
    return HASHER.key("/v1/completions", {"model": "m", "prompt": prompt})


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_token_keys_are_the_subscribers_keys_parsed_or_raw():
    """The proxy keys a token-id prompt as the subscriber keys the blocks a server reports
    (whatever the model; raw or parsed body); text and batches get no token keys."""
    want = prefix_keys(PROMPT, B)
    assert list(key(PROMPT).token_keys) == want and len(want) == 3
    assert list(HASHER.key("/v1/completions", {"model": "other", "prompt": PROMPT})
                .token_keys) == want
    split = parse_body(json.dumps({"model": "m", "prompt": PROMPT}).encode())
    assert list(HASHER.key("/v1/completions", split.fields).token_keys) == want
    assert HASHER.key("/v1/completions", {"prompt": "some text " * 20}).token_keys is None
    assert HASHER.key("/v1/completions", {"prompt": [PROMPT, PROMPT]}).token_keys is None
    assert Hasher(B).key("/v1/completions", {"prompt": PROMPT}).token_keys is None   # events off


def test_the_router_follows_the_events_over_its_guess(servers):
    """The table (guess) says A holds the prompt; A's events say it holds nothing and B's
    that B holds its first 2 blocks (routed there by another proxy, say): B is chosen, a
    cache hit of 2 blocks; the lookups are counted as events."""
    a, b = servers
    feed, registry = follow(servers)
    try:
        router = Router([a.backend, b.backend], "cache_aware", events=feed)
        k = key(PROMPT)
        router.record(k, a.backend)                                    # the guess
        b.publisher.publish([stored(PROMPT[:8], first=1)])
        wait_for(lambda: feed.usable(a.name) and feed.usable(b.name)
                 and feed.subscriber.cached_prefix_keys(b.name, k.token_keys) == 2)
        choice = router.choose(k)
        assert choice.order[0] is b.backend and choice.decision == "cache_hit"
        assert choice.matched == {a.name: 0, b.name: 2}
        assert metric(registry, "kvrelay_proxy:kv_events_lookups_total",
                      backend=b.name, source="events") == 1
        assert metric(registry, "kvrelay_proxy:kv_events_matched_blocks_total",
                      backend=b.name, source="events") == 2
        assert metric(registry, "kvrelay_proxy:kv_events_stream_up", backend=a.name) == 1
        assert metric(registry, "kvrelay_proxy:kv_events_batches_total", backend=b.name) >= 1
        text = router.choose(HASHER.key("/v1/completions", {"prompt": "text " * 40}))
        assert text.decision == "least_loaded"                       # no token keys: guess
        assert metric(registry, "kvrelay_proxy:kv_events_lookups_total",
                      backend=b.name, source="events") == 1
    finally:
        feed.stop()


def test_a_silent_stream_falls_back_to_the_guess(servers):
    """A's publisher goes away: within stale_s A's stream is no longer used (stream_up 0)
    and the router's guess for A counts again; B's live events still do."""
    a, b = servers
    feed, registry = follow(servers, stale_s=0.6)
    try:
        router = Router([a.backend, b.backend], "cache_aware", events=feed)
        k = key(PROMPT)
        router.record(k, a.backend)
        wait_for(lambda: feed.usable(a.name) and feed.usable(b.name))
        assert router.choose(k).matched[a.name] == 0                  # A's events: nothing
        a.publisher.shutdown()
        wait_for(lambda: not feed.usable(a.name))
        assert metric(registry, "kvrelay_proxy:kv_events_stream_up", backend=a.name) == 0
        choice = router.choose(k)
        assert choice.matched == {a.name: 3, b.name: 0}              # A: the table's 3 blocks
        assert choice.order[0] is a.backend and choice.decision == "cache_hit"
        assert metric(registry, "kvrelay_proxy:kv_events_lookups_total",
                      backend=a.name, source="guess") == 1
        assert feed.usable(b.name)
    finally:
        feed.stop()


def test_a_stream_keyed_with_another_block_size_is_not_used():
    other = Server(block_size=2)
    feed, _ = follow([other])
    try:
        other.publisher.publish([Stored(0, [h(1)], None, PROMPT[:2])])
        wait_for(lambda: feed.subscriber.view(other.name).block_size == 2)
        assert not feed.usable(other.name)
        assert feed.refine(key(PROMPT), {other.name: 1}) == {other.name: 1}
    finally:
        feed.stop()
        other.publisher.shutdown()


# -- flags ------------------------------------------------------------------------------------
def settings(*flags: str):
    return proxy_main.settings_from_args(proxy_main.build_parser().parse_args(list(flags)))


def test_flags_pair_event_ports_with_the_prefill_servers(monkeypatch):
    s = settings("--prefiller-host", "10.0.0.1", "10.0.0.2", "--prefiller-port", "8100",
                 "--kv-events-port", "5557", "--kv-events-replay-port", "5558")
    ev = s.routing.kv_events
    assert ev is not None and not ev.auth
    assert [(x.name, x.endpoint, x.replay_endpoint) for x in ev.sources] == [
        ("10.0.0.1:8100", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        ("10.0.0.2:8100", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558")]
    one_host = settings("--prefiller-port", "8100", "8101", "--kv-events-port", "5557", "5559")
    assert [x.endpoint for x in one_host.routing.kv_events.sources] == [
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559"]
    assert one_host.routing.kv_events.sources[0].replay_endpoint is None
    assert settings().routing.kv_events is None
    monkeypatch.setenv("KVRELAY_KV_SECRET", "x")
    assert settings("--kv-events-port", "5557", "--kv-events-auth", "kv_secret").routing \
        .kv_events.auth


@pytest.mark.parametrize("flags, message", [
    (["--routing", "round_robin", "--kv-events-port", "5557"], "needs --routing cache_aware"),
    (["--prefiller-port", "1", "2", "3", "--kv-events-port", "5", "6"],
     "2 ports for 3 prefill servers"),
    (["--kv-events-port", "0"], "is not a TCP port"),
    (["--kv-events-replay-port", "5558"], "--kv-events-replay-port needs --kv-events-port"),
    (["--kv-events-port", "5557", "--kv-events-auth", "kv_secret"], "needs the KV secret"),
    (["--kv-events-port", "5557", "--kv-events-secret-file", "/x"],
     "--kv-events-secret-file needs --kv-events-auth kv_secret"),
])
def test_bad_event_flags_name_the_flag(monkeypatch, flags, message):
    monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    with pytest.raises(EndpointError, match=message):
        settings(*flags)


# -- e2e: real servers ------------------------------------------------------------------------
def test_two_prefills_one_decode_route_by_their_events(tiny, tmp_path, monkeypatch):  # noqa: F811
    """2 prefill servers publishing KV events with "auth": "kv_secret", 1 decode, and two
    proxies following the events (as two proxy replicas behind a balancer). A conversation
    started through proxy 1 lands on prefill 1; continued through proxy 2, which never
    routed it (its own guess would pick prefill 0, first in its rotation), it returns to
    prefill 1 — a cache hit from the events, with the server's own prefix-cache hits."""
    from tests.e2e.disagg import start
    secret = "e2e KV secret"
    env = {"UCX_TLS": "tcp", "KVRELAY_KV_SECRET": secret}
    monkeypatch.setenv("KVRELAY_KV_SECRET", secret)
    ports = [(free_port(), free_port()) for _ in range(2)]
    prefills = [start(str(tiny[0]), "kv_producer", tmp_path / f"prefill{i}.log", env=env,
                      flags=["--kv-events-config", json.dumps({
                          "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}",
                          "bind": True, "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                          "auth": "kv_secret"})])
                for i, (pub, replay) in enumerate(ports)]
    decode = start(str(tiny[0]), "kv_consumer", tmp_path / "decode.log", env=env)
    proxies: list[tuple[KvrelayProcess, str]] = []
    try:
        for s in prefills + [decode]:
            s.wait_ready()
        for i in range(2):
            port = free_port()
            proxies.append((KvrelayProcess(
                ["proxy", "--port", str(port), "--log-level", "debug", "--prefiller-port",
                 *[str(p.port) for p in prefills], "--decoder-port", str(decode.port),
                 "--routing-block-size", "4", "--kv-events-port", *[str(p) for p, _ in ports],
                 "--kv-events-replay-port", *[str(r) for _, r in ports],
                 "--kv-events-auth", "kv_secret"], tmp_path / f"proxy{i}.log", env=env),
                f"http://127.0.0.1:{port}"))
        for proc, url in proxies:
            proc.wait_for_line("Application startup complete")
            wait_for(lambda url=url: _metric(url, "kvrelay_proxy:kv_events_stream_up") == 2,
                     timeout=60)
        one = proxies[0][1]
        _complete(one, [5, 6, 7, 8, 9, 10, 11, 12, 13], "warm-up")        # → prefill 0
        tokens = [p.metrics()["vllm:prompt_tokens_total"] for p in prefills]
        prompt = [(7 * i) % 150 + 4 for i in range(40)]                   # 10 blocks of 4
        _complete(one, prompt, "turn-1")                                  # → prefill 1
        grew = [p.metrics()["vllm:prompt_tokens_total"] - t for p, t in zip(prefills, tokens)]
        assert grew == [0, 40]
        holder = prefills[1]
        hits = holder.metrics()["vllm:prefix_cache_hits_total"]
        two = proxies[1][1]
        wait_for(lambda: _metric(two, "kvrelay_proxy:kv_events_batches_total",
                                 f'backend="127.0.0.1:{holder.port}"') >= 1)
        _complete(two, prompt + [9, 9, 9, 9], "turn-2")                   # the other proxy
        assert holder.metrics()["vllm:prefix_cache_hits_total"] - hits >= 36
        line = next(x for x in proxies[1][0].log().splitlines() if "request turn-2: route:" in x)
        assert f"127.0.0.1:{holder.port} (cache_hit, " in line, line
        assert _metric(two, "kvrelay_proxy:kv_events_lookups_total", 'source="events"') == 2
    finally:
        for proc, _ in proxies:
            proc.stop()
        for s in prefills + [decode]:
            s.stop()


def _complete(url: str, prompt: list[int], request_id: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Request-Id": request_id},
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of `name`'s samples (those whose labels include `label`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)
