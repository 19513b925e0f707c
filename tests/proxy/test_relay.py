"""End to end: a real `kvrelay proxy` process in front of scripted fake prefill/decode servers."""
from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.proxy.routing import COOLDOWN_S
from tests.proxy.fakes import STREAM_TOKENS, client, kv_params_of, wait_for

NULL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


def served_by(fakes, request_id: str):
    """The fake prefill that prefilled this request."""
    hits = [f for f in fakes.prefill
            if any(r.headers.get("x-request-id") == request_id for r in f.completions())]
    assert len(hits) == 1, f"request {request_id} prefilled {len(hits)} times"
    return hits[0]


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ------------------------------------------------------------------ wire format

def test_completion_bodies_and_request_id(fakes, proxies):
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 7, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2, "n": 1,
            "kv_transfer_params": {"client": "ignored"}}
    with client() as c, c.stream("POST", f"{proxies['main'].url}/v1/completions", json=body,
                                 headers={"X-Request-Id": "req-abc",
                                          "Authorization": "Bearer sk-test"}) as r:
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "req-abc"
        list(r.iter_lines())
    prefill = served_by(fakes, "req-abc")
    [p] = prefill.completions()
    assert p.path == "/v1/completions"
    assert p.body == {"model": "m", "prompt": "The capital of France is", "max_tokens": 1,
                      "temperature": 0, "stream": False, "n": 1, "kv_transfer_params": NULL_KV}
    [d] = fakes.decode.completions()
    assert d.path == "/v1/completions"
    assert d.body == body | {"kv_transfer_params": kv_params_of(prefill, "req-abc")}
    for rec in (p, d):
        assert rec.headers["x-request-id"] == "req-abc"
        assert rec.headers["authorization"] == "Bearer sk-test"


def test_chat_bodies_new_request_id(fakes, proxies):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9,
            "min_completion_tokens": 3, "min_tokens": 1, "stream": False}
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "".join(STREAM_TOKENS)
    [d] = fakes.decode.completions()
    request_id = d.headers["x-request-id"]
    uuid.UUID(request_id)                                   # the proxy made one
    assert r.headers["x-request-id"] == request_id
    prefill = served_by(fakes, request_id)
    [p] = prefill.completions()
    assert p.path == d.path == "/v1/chat/completions"
    assert p.body == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 1,
                      "max_completion_tokens": 1, "stream": False, "kv_transfer_params": NULL_KV}
    assert "authorization" not in p.headers and "authorization" not in d.headers
    assert d.body == body | {"kv_transfer_params": kv_params_of(prefill, request_id)}


@pytest.mark.parametrize("advertised", ["0.0.0.0", ""])
def test_unroutable_remote_host_replaced_by_prefill_host(fakes, proxies, advertised):
    for f in fakes.prefill:
        f.script.remote_host = advertised
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", json={"prompt": "x", "max_tokens": 3},
                   headers={"X-Request-Id": "req-host"})
    assert r.status_code == 200
    [d] = fakes.decode.completions()
    expected = kv_params_of(served_by(fakes, "req-host"), "req-host") | {"remote_host": "127.0.0.1"}
    assert d.body["kv_transfer_params"] == expected


def test_round_robin_over_three_ports_on_one_host(fakes, proxies):
    order = []
    with client() as c:
        # An earlier test may have left a server cooling down (tried last for COOLDOWN_S
        # after a failure); once all three answer again the rotation is plain.
        deadline = time.monotonic() + COOLDOWN_S + 2
        while len({f.port for f in fakes.prefill if f.completions()}) < 3:
            assert time.monotonic() < deadline, "a prefill server stayed out of the rotation"
            c.post(f"{proxies['main'].url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            time.sleep(0.05)
        for f in fakes.all:
            f.requests.clear()
        for i in range(6):
            r = c.post(f"{proxies['main'].url}/v1/completions",
                       json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": f"rr-{i}"})
            assert r.status_code == 200
            order.append(served_by(fakes, f"rr-{i}").port)
    assert sorted(set(order)) == sorted(f.port for f in fakes.prefill)
    assert order[:3] == order[3:]                           # a fixed cycle over all three
    assert len(fakes.decode.completions()) == 6


# ------------------------------------------------------------------ streaming

def test_sse_passes_through_chunk_by_chunk(fakes, proxies):
    fakes.decode.script.chunk_delay_s = 0.1
    arrivals = []
    with client() as c, c.stream("POST", f"{proxies['main'].url}/v1/completions",
                                 json={"prompt": "x", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic(), line[len("data: "):]))
    data = [d for _, d in arrivals]
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == STREAM_TOKENS
    # unbuffered: the first token reached the client long before the stream ended
    assert arrivals[-1][0] - arrivals[0][0] > 0.3


def test_openai_client_through_the_proxy(fakes, proxies):
    oai = openai.OpenAI(base_url=f"{proxies['main'].url}/v1", api_key="sk-x",
                        http_client=httpx.Client(trust_env=False))
    out = oai.completions.create(model="fake-model", prompt="The capital of France is",
                                 max_tokens=5)
    assert out.choices[0].text == "".join(STREAM_TOKENS)
    chunks = list(oai.chat.completions.create(model="fake-model",
                                              messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, stream=True))
    assert "".join(ch.choices[0].delta.content for ch in chunks) == "".join(STREAM_TOKENS)
    assert [m.id for m in oai.models.list().data] == ["fake-model"]
    assert fakes.decode.completions()[0].headers["authorization"] == "Bearer sk-x"


def test_client_disconnect_cancels_decode_stream(fakes, proxies):
    fakes.decode.script.mode = "slow_stream"
    with client() as c, c.stream("POST", f"{proxies['main'].url}/v1/completions",
                                 json={"prompt": "x", "max_tokens": 500, "stream": True},
                                 headers={"X-Request-Id": "req-gone"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: "stream_cancelled" in fakes.decode.events, what="decode stream cancelled")
    prefill = served_by(fakes, "req-gone")
    wait_for(lambda: prefill.frees(), what="free notice")
    assert prefill.frees()[0].body == {"remote_request_id": "prefill-req-gone",
                                       "remote_engine_id": f"engine-{prefill.port}"}


def test_client_disconnect_during_prefill_cancels_it(fakes, proxies):
    for f in fakes.prefill:
        f.script.mode = "slow"
    body = json.dumps({"prompt": "x", "max_tokens": 3}).encode()
    with socket.create_connection(("127.0.0.1", proxies["main"].port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: any(f.completions() for f in fakes.prefill), what="prefill request")
    wait_for(lambda: any("prefill_disconnected" in f.events for f in fakes.prefill),
             what="prefill abort")
    assert fakes.decode.completions() == []


def test_decode_stream_cut_ends_with_error_event(fakes, proxies):
    fakes.decode.script.mode = "break"
    with client() as c, c.stream("POST", f"{proxies['main'].url}/v1/completions",
                                 json={"prompt": "x", "max_tokens": 5, "stream": True},
                                 headers={"X-Request-Id": "req-cut"}) as r:
        data = sse_data(list(r.iter_lines()))
    assert [json.loads(d)["choices"][0]["text"] for d in data[:2]] == STREAM_TOKENS[:2]
    assert json.loads(data[2])["error"]["code"] == 503 and data[3] == "[DONE]"
    wait_for(lambda: served_by(fakes, "req-cut").frees(), what="free notice")


def test_decode_stream_cut_mid_event_drops_the_connection(fakes, proxies):
    fakes.decode.script.mode = "break_mid_event"
    received = []
    with client() as c, c.stream("POST", f"{proxies['main'].url}/v1/completions",
                                 json={"prompt": "x", "max_tokens": 5, "stream": True},
                                 headers={"X-Request-Id": "req-cut2"}) as r, \
            pytest.raises(httpx.RemoteProtocolError):
        for line in r.iter_lines():
            received.append(line)  # noqa: PERF402  (keeps the lines that came before the error)
    texts = [json.loads(d)["choices"][0]["text"] for d in sse_data(received)[:2]]
    assert texts == STREAM_TOKENS[:2]
    assert "[DONE]" not in sse_data(received)
    wait_for(lambda: served_by(fakes, "req-cut2").frees(), what="free notice")


# ------------------------------------------------------------------ failures

def test_prefill_4xx_returned_unchanged_without_decode(fakes, proxies):
    for f in fakes.prefill:
        f.script.status = 400
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "scripted 400 from prefill", "type": "BadRequestError",
                                  "param": None, "code": 400}}
    assert sum(len(f.completions()) for f in fakes.prefill) == 1      # not retried elsewhere
    assert fakes.decode.completions() == []


def test_decode_error_returned_and_prefill_told_to_free(fakes, proxies):
    fakes.decode.script.status = 500
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions",
                   json={"prompt": "x", "max_tokens": 3, "stream": True},
                   headers={"X-Request-Id": "req-free"})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "scripted 500 from decode"
    prefill = served_by(fakes, "req-free")
    wait_for(lambda: prefill.frees(), what="free notice")
    [notice] = prefill.frees()
    assert notice.body == {"remote_request_id": "prefill-req-free",
                           "remote_engine_id": f"engine-{prefill.port}"}
    assert notice.headers["x-request-id"] == "req-free"


def test_dead_servers_are_skipped(fakes, proxies):
    a = fakes.prefill[0]
    with client() as c:
        for i in range(4):
            r = c.post(f"{proxies['skipping'].url}/v1/completions",
                       json={"prompt": "x", "max_tokens": 3}, headers={"X-Request-Id": f"skip-{i}"})
            assert r.status_code == 200, r.text
    assert len(a.completions()) == 4 and len(fakes.decode.completions()) == 4
    metrics = _samples(proxies["skipping"])
    dead_prefill = f"127.0.0.1:{fakes.refused[0]}"
    assert metrics[("kvrelay_proxy:backend_failures_total",
                    (("backend", dead_prefill), ("reason", "connect"), ("role", "prefill")))] >= 1


def test_every_prefill_down_is_503(fakes, proxies):
    with client() as c:
        r = c.post(f"{proxies['no_prefill'].url}/v1/completions",
                   json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    for port in fakes.refused:
        assert f"127.0.0.1:{port} (connection refused)" in error["message"]
    assert fakes.decode.completions() == []


def test_prefill_5xx_after_a_refused_server_is_returned_as_is(fakes, proxies):
    fakes.prefill[0].script.status = 500
    with client() as c:
        r = c.post(f"{proxies['skipping'].url}/v1/completions",
                   json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "scripted 500 from prefill"
    assert len(fakes.prefill[0].completions()) == 1
    assert fakes.decode.completions() == []


def test_decode_down_is_503_and_prefill_told_to_free(fakes, proxies):
    with client() as c:
        r = c.post(f"{proxies['no_decode'].url}/v1/completions",
                   json={"prompt": "x", "max_tokens": 3}, headers={"X-Request-Id": "req-nodecode"})
    assert r.status_code == 503
    assert "no decode server" in r.json()["error"]["message"]
    a = fakes.prefill[0]
    wait_for(lambda: a.frees(), what="free notice")
    assert a.frees()[0].body["remote_request_id"] == "prefill-req-nodecode"


def test_malformed_json_is_400(proxies):
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


# ------------------------------------------------------------------ health, models, metrics

def test_health_200_only_when_every_backend_is_up(fakes, proxies):
    url = f"{proxies['main'].url}/health"
    with client() as c:
        r = c.get(url)
        assert r.status_code == 200 and r.json()["down"] == []
        fakes.prefill[1].script.health = 503
        r = c.get(url)
        assert r.status_code == 503
        assert r.json()["down"] == [{"role": "prefill",
                                     "server": f"127.0.0.1:{fakes.prefill[1].port}",
                                     "healthy": False, "error": "HTTP 503"}]
        fakes.prefill[1].script.health = 200
        assert c.get(url).status_code == 200
        wait_for(lambda: _samples(proxies["main"])[("kvrelay_proxy:backend_healthy", (
            ("backend", f"127.0.0.1:{fakes.prefill[1].port}"), ("role", "prefill")))] == 1,
            what="the background probe to see it healthy again")
        r = c.get(f"{proxies['skipping'].url}/health")
    assert r.status_code == 503
    assert {s["server"] for s in r.json()["down"]} == {f"127.0.0.1:{p}" for p in fakes.refused}


def test_models_forwarded_to_decode(fakes, proxies):
    with client() as c:
        r = c.get(f"{proxies['main'].url}/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["owned_by"] == "decode"


def _samples(proxy) -> dict:
    with client() as c:
        text = c.get(f"{proxy.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse(fakes, proxies):
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        text = c.get(f"{proxies['main'].url}/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)
                if not f.name.endswith("_created")}
    assert families == {"kvrelay_proxy:requests": "counter",
                        "kvrelay_proxy:backend_in_flight": "gauge",
                        "kvrelay_proxy:prefill_latency_seconds": "histogram",
                        "kvrelay_proxy:decode_latency_seconds": "histogram",
                        "kvrelay_proxy:backend_failures": "counter",
                        "kvrelay_proxy:kv_free_notices": "counter",
                        "kvrelay_proxy:backend_healthy": "gauge",
                        "kvrelay_proxy:routing_decisions": "counter",
                        "kvrelay_proxy:prefix_table_blocks": "gauge",
                        "kvrelay_proxy:prefix_table_forgotten": "counter",
                        "kvrelay_proxy:prefill_busy_retries": "counter",
                        "kvrelay_proxy:backends": "gauge",
                        "kvrelay_proxy:backend_info": "gauge"}
    samples = _samples(proxies["main"])
    assert samples[("kvrelay_proxy:requests_total",
                    (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    decode = f"127.0.0.1:{fakes.decode.port}"
    assert samples[("kvrelay_proxy:decode_latency_seconds_count", (("backend", decode),))] >= 1
    assert sum(samples[("kvrelay_proxy:prefill_latency_seconds_count",
                        (("backend", f"127.0.0.1:{f.port}"),))]
               for f in fakes.prefill) >= 1
    wait_for(lambda: all(v == 0 for (n, _), v in _samples(proxies["main"]).items()
                         if n == "kvrelay_proxy:backend_in_flight"), what="in-flight back to 0")
