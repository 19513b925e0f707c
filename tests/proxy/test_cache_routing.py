"""A real proxy process (default --routing cache_aware, --disagg-policy auto) in front of fake
prefill and decode servers: which server each request reaches, and the decision metrics."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import free_port
from tests.proxy.fakes import FakeBackend, ProxyProcess, client, proxy_args, vllm_metrics, wait_for

LOCAL = "127.0.0.1"
LONG = "the quick brown fox jumps over the lazy dog " * 40     # ~440 tokens at 4 chars/token


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """prefill A B, decode D E, 0.2 s probes; two proxies, both cache_aware (the default):
    `auto` (64 direct tokens) and `always` (the default disagg policy)."""
    fakes = [FakeBackend(role).start() for role in ("prefill", "prefill", "decode", "decode")]
    proxies: list[ProxyProcess] = []
    logs = tmp_path_factory.mktemp("routed")
    try:
        a, b, d, e = fakes
        for name, extra in (("auto", ["--disagg-policy", "auto", "--direct-max-tokens", "64"]),
                            ("always", [])):
            args = proxy_args(free_port(), [LOCAL], [a.port, b.port], [LOCAL], [d.port, e.port])
            proxies.append(ProxyProcess(args + ["--health-interval", "0.2", *extra],
                                        logs / f"{name}.log"))
        for p in proxies:
            p.wait_ready()
        yield proxies[0], fakes, proxies[1]
    finally:
        for p in proxies:
            p.stop()
        for f in fakes:
            f.stop()


@pytest.fixture(autouse=True)
def _reset(routed):
    for f in routed[1]:
        f.reset()


def decisions(proxy: ProxyProcess) -> dict[tuple[str, str], float]:
    with client() as c:
        text = c.get(f"{proxy.url}/metrics").text
    return {(s.labels["role"], s.labels["decision"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "kvrelay_proxy:routing_decisions_total"}


def post(proxy: ProxyProcess, prompt: str, request_id: str, chat: bool = False) -> None:
    with client() as c:
        if chat:
            body = {"model": "m", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 2}
            r = c.post(f"{proxy.url}/v1/chat/completions", json=body,
                       headers={"X-Request-Id": request_id})
        else:
            r = c.post(f"{proxy.url}/v1/completions",
                       json={"model": "m", "prompt": prompt, "max_tokens": 2},
                       headers={"X-Request-Id": request_id})
    assert r.status_code == 200, r.text


def reached(fakes: list[FakeBackend], request_id: str) -> list[int]:
    return [f.port for f in fakes for r in f.completions()
            if r.headers.get("x-request-id") == request_id]


def test_a_repeated_prompt_returns_to_the_prefill_that_has_it(routed):
    _, (a, b, _, _), proxy = routed
    before = decisions(proxy)
    post(proxy, LONG + "first question", "conv-1")
    first = reached([a, b], "conv-1")
    assert len(first) == 1
    for i in range(4):                              # the same conversation, growing
        post(proxy, LONG + "first question" + " and more" * (i + 1), f"conv-{i + 2}", )
        assert reached([a, b], f"conv-{i + 2}") == first
    after = decisions(proxy)
    assert after[("prefill", "cache_hit")] - before.get(("prefill", "cache_hit"), 0) == 4
    assert after[("disagg", "prefill_then_decode")] - before[("disagg", "prefill_then_decode")] == 5
    assert "route: prefill then decode (policy always); prefill" in proxy.log()
    assert "(cache_hit, " in proxy.log()


def test_auto_sends_a_conversation_the_decode_holds_straight_to_it(routed):
    proxy, (a, b, d, e), _ = routed
    post(proxy, LONG + "turn one", "turn-1")                     # long: prefill then decode
    assert len(reached([a, b], "turn-1")) == 1
    [decoder] = reached([d, e], "turn-1")
    post(proxy, LONG + "turn one" + " turn two", "turn-2")       # the decode holds ~all of it
    assert reached([a, b], "turn-2") == []
    assert reached([d, e], "turn-2") == [decoder]                # and it is the same decode


def test_a_short_prompt_under_auto_never_touches_a_prefill(routed):
    proxy, (a, b, d, e), _ = routed
    before = decisions(proxy)
    post(proxy, "w5 w17 w29", "short-1")
    post(proxy, "hello there", "short-2", chat=True)
    assert reached([a, b], "short-1") == reached([a, b], "short-2") == []
    got = [r for f in (d, e) for r in f.completions()]
    assert len(got) == 2 and all("kv_transfer_params" not in r.body for r in got)
    after = decisions(proxy)
    assert after[("disagg", "direct_to_decode")] - before[("disagg", "direct_to_decode")] == 2
    assert "route: direct to decode (" in proxy.log()


def test_decode_chosen_by_reported_kv_usage_and_running(routed):
    proxy, (_, _, d, e), _ = routed
    d.script.metrics = vllm_metrics(running=0, kv_usage=0.99)     # D nearly full
    e.script.metrics = vllm_metrics(running=1, kv_usage=0.10)
    time.sleep(0.6)                                                 # a few probe rounds
    for i in range(3):
        post(proxy, f"short {i}", f"kvfull-{i}")
        assert reached([d, e], f"kvfull-{i}") == [e.port]
    d.script.metrics = vllm_metrics(running=0, kv_usage=0.10)
    e.script.metrics = vllm_metrics(running=6, kv_usage=0.10)      # E busy with others' work
    time.sleep(0.6)
    for i in range(3):
        post(proxy, f"other {i}", f"busy-{i}")
        assert reached([d, e], f"busy-{i}") == [d.port]
    d.script.metrics = e.script.metrics = None


def test_an_unhealthy_prefill_is_forgotten_and_traffic_moves(routed):
    _, (a, b, _, _), proxy = routed
    prompt = "an unhealthy server's conversation " * 20
    post(proxy, prompt, "sick-1")
    [holder] = reached([a, b], "sick-1")
    sick, well = (a, b) if holder == a.port else (b, a)
    sick.script.health = 503
    wait_for(lambda: f"prefill server {sick.url.removeprefix('http://')}: forgot" in proxy.log(),
             timeout=5, what="the table entries dropped")
    post(proxy, prompt + " again", "sick-2")
    assert reached([a, b], "sick-2") == [well.port]
    sick.script.health = 200
    wait_for(lambda: proxy.log().count(f"{sick.url.removeprefix('http://')} is healthy again") >= 1,
             timeout=5, what="healthy again")
    post(proxy, prompt + " and again", "sick-3")                   # the cache is on `well` now
    assert reached([a, b], "sick-3") == [well.port]


def test_a_prefill_reporting_no_hits_loses_its_entries(routed):
    _, (a, b, _, _), proxy = routed
    a.script.metrics = b.script.metrics = vllm_metrics(queries=10, hits=0)
    try:
        time.sleep(0.6)                                   # a scrape starts the check window
        prompt = "a prompt the servers keep evicting. " * 60   # ~540 tokens
        # one cache hit (~528 tokens) is enough to check (HIT_CHECK_TOKENS 512), and only the
        # second answer makes it so: a third request could be learned after the correction
        for i in range(2):
            post(proxy, prompt + str(i), f"miss-{i}")
        wait_for(lambda: "reported fewer prefix-cache hits than expected" in proxy.log(),
                 timeout=5, what="the hit-rate correction")
        assert decisions(proxy)[("prefill", "cache_hit")] >= 1
        post(proxy, prompt + "3", "miss-3")
        assert "request miss-3: route: prefill then decode (policy always); prefill " \
               "127.0.0.1" in proxy.log()
        line = next(x for x in proxy.log().splitlines() if "request miss-3: route:" in x)
        assert "(least_loaded, 0/" in line                # nothing left to match
    finally:
        a.script.metrics = b.script.metrics = None
