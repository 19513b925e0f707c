"""A busy prefill (503 + Retry-After: "KV hold refused") is retried: on the next prefill
server, then in rounds with backoff, within --prefill-busy-retry; the client sees one
answer, the decode server one request. The proxy app runs in this process (TestClient),
the fake servers in threads."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.proxy.app import build_app
from kvrelay.proxy.legs import MAX_BUSY_ROUNDS
from kvrelay.proxy.policy import RoutingSettings
from tests.proxy.fakes import STREAM_TOKENS, FakeBackend, Script, fake_servers

BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 5}


@pytest.fixture(scope="module")
def servers():
    with fake_servers(("prefill", "prefill", "decode")) as started:
        yield started


@pytest.fixture
def backends(servers):
    for fake in servers:
        fake.reset()
    return servers


def proxy(prefills: list[FakeBackend], decode: FakeBackend, busy_retry_s: float = 10.0):
    app = build_app([("127.0.0.1", f.port) for f in prefills], [("127.0.0.1", decode.port)],
                    health_interval_s=0, routing=RoutingSettings(routing="round_robin"),
                    busy_retry_s=busy_retry_s)
    return TestClient(app)


def busy_retries(c: TestClient) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name == "kvrelay_proxy:prefill_busy_retries_total":
                out[s.labels["backend"]] = s.value
    return out


def test_a_busy_prefill_is_retried_on_the_other_server(backends):
    a, b, decode = backends
    a.script = Script(busy_answers=100)
    with proxy([a, b], decode) as c:
        for i in range(2):                       # round robin: each server comes first once
            r = c.post("/v1/completions", json=BODY, headers={"X-Request-Id": f"busy-{i}"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "".join(STREAM_TOKENS)
        assert busy_retries(c) == {f"127.0.0.1:{a.port}": 1, f"127.0.0.1:{b.port}": 0}
    assert len(a.completions()) == 1 and len(b.completions()) == 2
    assert [d.body["kv_transfer_params"]["remote_engine_id"] for d in decode.completions()] == \
        [f"engine-{b.port}"] * 2


def test_every_prefill_busy_backs_off_and_goes_round_again(backends):
    a, b, decode = backends
    a.script, b.script = Script(busy_answers=1), Script(busy_answers=1)
    with proxy([a, b], decode) as c:
        t0 = time.monotonic()
        with c.stream("POST", "/v1/completions", json=BODY | {"stream": True},
                      headers={"X-Request-Id": "round-2"}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        took = time.monotonic() - t0
        assert sum(busy_retries(c).values()) == 2
    assert len(a.completions()) + len(b.completions()) == 3          # busy, busy, answered
    assert len(decode.completions()) == 1                            # one decode, one stream
    assert lines[-1] == "data: [DONE]" and len(lines) == len(STREAM_TOKENS) + 1
    assert took >= 0.1                                               # the first backoff


def test_busy_until_the_retry_window_closes_returns_the_503(backends):
    a, _, decode = backends
    a.script = Script(busy_answers=1000)
    with proxy([a], decode, busy_retry_s=0.5) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=BODY, headers={"X-Request-Id": "never"})
        took = time.monotonic() - t0
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1" and r.headers["x-request-id"] == "never"
        assert r.json()["error"]["message"].startswith("KV hold refused")
        retried = busy_retries(c)[f"127.0.0.1:{a.port}"]
    assert 2 <= len(a.completions()) <= MAX_BUSY_ROUNDS and retried == len(a.completions()) - 1
    assert took < 3
    assert decode.completions() == []


def test_no_retry_window_means_no_retry(backends):
    a, b, decode = backends
    a.script, b.script = Script(busy_answers=1), Script(busy_answers=1)
    with proxy([a, b], decode, busy_retry_s=0) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and busy_retries(c) == {f"127.0.0.1:{a.port}": 0,
                                                             f"127.0.0.1:{b.port}": 0}
    assert len(a.completions()) + len(b.completions()) == 1
