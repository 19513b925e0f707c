"""`kvrelay proxy --backends-file`: a set of backends that changes while requests are in
flight. The file is rewritten as a supervisor does (a temporary file renamed over it); the
proxy app runs in this process (uvicorn in a thread, as the fake servers do) and follows it.
Every request must come back 200 with its whole body; a removed server gets nothing new,
finishes what it has (a prefill: until the decode that pulls its KV ends, or its free notice
is sent), then goes from the metrics. Then the file's format, the state's bookkeeping
(prefix table, KV-event sources, stored responses), the flags, and one e2e: a real proxy
process."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.proxy import legs
from kvrelay.proxy import state as proxy_state
from kvrelay.proxy.app import build_app
from kvrelay.proxy.backend_set import BackendsFile, BackendsFileError, BackendSpec, diff, parse
from kvrelay.proxy.kv_events_feed import KVEventsRouting
from kvrelay.proxy.main import main
from kvrelay.proxy.policy import RoutingSettings
from kvrelay.proxy.prefix import Hasher
from kvrelay.proxy.routing import Backend
from tests.processes import free_port
from tests.proxy.fakes import (
    STREAM_TOKENS,
    FakeBackend,
    ProxyProcess,
    Script,
    client,
    fake_servers,
    wait_for,
)

BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 5}
WHOLE = "".join(STREAM_TOKENS)
POLL_S = 0.05                     # the proxy's look at the file, shortened for the tests
CHANGE_S = 10.0                   # how long a change may take to show (a loaded machine)


@pytest.fixture(scope="module")
def fleet():
    """Prefill servers A B C, decode servers D E (threads)."""
    with fake_servers(("prefill", "prefill", "prefill", "decode", "decode")) as started:
        yield started


@pytest.fixture
def servers(fleet):
    for fake in fleet:
        fake.reset()
    return fleet


def entry(server_id: str, fake: FakeBackend, **extra: Any) -> dict[str, Any]:
    return {"id": server_id, "url": fake.url, **extra}


def write(path: Path, prefill: list[dict[str, Any]] | None = None,
          decode: list[dict[str, Any]] | None = None) -> None:
    """The file as a supervisor writes it: whole, then renamed over the old one."""
    write_text(path, json.dumps({"prefill": prefill or [], "decode": decode or []}))


def write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def name(fake: FakeBackend) -> str:
    return f"127.0.0.1:{fake.port}"


class ProxyThread:
    """`build_app` with a backends file, served by uvicorn in a thread on 127.0.0.1."""

    def __init__(self, path: Path, routing: str = "round_robin") -> None:
        self.app = build_app([], [], health_interval_s=0.1,
                             routing=RoutingSettings(routing=routing),
                             backends_file=BackendsFile(path, poll_s=POLL_S))
        self.state: proxy_state.ProxyState = self.app.state.proxy
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self) -> ProxyThread:
        self.thread.start()
        wait_for(lambda: self.server.started, CHANGE_S, "the proxy to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@contextmanager
def running(path: Path, routing: str = "round_robin") -> Iterator[ProxyThread]:
    proxy = ProxyThread(path, routing).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def complete(url: str, request_id: str, stream: bool = False) -> tuple[int, str]:
    """(status, the text generated) of one completion through the proxy."""
    with client() as c:
        if not stream:
            r = c.post(f"{url}/v1/completions", json=BODY, headers={"X-Request-Id": request_id})
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            return r.status_code, text
        with c.stream("POST", f"{url}/v1/completions", json=BODY | {"stream": True},
                      headers={"X-Request-Id": request_id}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        if lines[-1:] != ["data: [DONE]"]:
            return r.status_code, f"stream without [DONE]: {lines}"
        return r.status_code, "".join(json.loads(line[6:])["choices"][0]["text"]
                                      for line in lines[:-1])


def metrics(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with client() as c:
        text = c.get(f"{url}/metrics").text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def states(url: str) -> dict[str, str]:
    """backend (host:port) → state, per kvrelay_proxy:backend_info."""
    return {dict(labels)["backend"]: dict(labels)["state"]
            for labels in metrics(url).get("kvrelay_proxy:backend_info", {})}


def wait_states(proxy: ProxyThread, expected: dict[str, str]) -> None:
    wait_for(lambda: states(proxy.url) == expected, CHANGE_S, f"backends {expected}")


def received(fake: FakeBackend) -> list[str]:
    return [r.headers["x-request-id"] for r in fake.completions()]


# -- changes under load -----------------------------------------------------------------------
def test_no_server_answers_503_until_the_file_lists_both_roles(servers, tmp_path):
    a, _, _, d, _ = servers
    path = tmp_path / "backends.json"
    write(path)
    with running(path) as proxy:
        with client() as c:
            r = c.post(f"{proxy.url}/v1/completions", json=BODY, headers={"X-Request-Id": "x"})
            health = c.get(f"{proxy.url}/health")
        assert r.status_code == 503 and r.headers["x-request-id"] == "x"
        assert r.json() == {"error": {
            "message": "no prefill server takes requests (none is listed); no decode server "
                       "takes requests (none is listed): try again later",
            "type": "ServiceUnavailableError", "param": None, "code": 503}}
        assert health.status_code == 503
        assert [s["role"] for s in health.json()["down"]] == ["prefill", "decode"]
        counts = metrics(proxy.url)["kvrelay_proxy:backends"]
        assert set(counts.values()) == {0.0} and len(counts) == 6
        write(path, decode=[entry("decode-0", d)])
        wait_states(proxy, {name(d): "active"})
        status, text = complete(proxy.url, "decode-only")
        assert status == 503 and "no prefill server takes requests (none is listed)" in text
        assert "decode server" not in text
        write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
        wait_states(proxy, {name(a): "active", name(d): "active"})
        assert complete(proxy.url, "both") == (200, WHOLE)
        with client() as c:
            assert c.get(f"{proxy.url}/health").status_code == 200
    assert received(a) == ["both"] and received(d) == ["both"]


def test_a_removed_prefill_finishes_its_request_and_gets_no_new_one(servers, tmp_path):
    """A prefills one request slowly; the file replaces A by B meanwhile. A gets no other
    request; its request finishes — prefill, then the decode pulling A's KV — and A stays
    held (draining) until that decode ends, then goes from the metrics."""
    a, b, _, d, _ = servers
    a.script = Script(delay_s=1.0)
    d.script = Script(chunk_delay_s=0.3)          # the decode of A's request: ~1.5 s
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    with running(path) as proxy, ThreadPoolExecutor(6) as pool:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        first = pool.submit(complete, proxy.url, "on-a", True)
        wait_for(lambda: received(a) == ["on-a"], CHANGE_S, "A to have the request")
        write(path, prefill=[entry("prefill-1", b)], decode=[entry("decode-0", d)])
        wait_states(proxy, {name(a): "draining", name(b): "active", name(d): "active"})
        later = [pool.submit(complete, proxy.url, f"after-{i}", i % 2 == 0) for i in range(4)]
        wait_for(lambda: "on-a" in received(d), CHANGE_S, "the decode of A's request")
        # A answered; its request now holds it while the decode pulls the KV
        assert states(proxy.url)[name(a)] == "draining" and not first.done()
        results = [f.result(timeout=30) for f in [first, *later]]
        assert results == [(200, WHOLE)] * 5
        wait_states(proxy, {name(b): "active", name(d): "active"})
        gone = [labels for family in metrics(proxy.url).values() for labels in family
                if ("backend", name(a)) in labels]
        assert gone == []
    assert received(a) == ["on-a"]
    assert sorted(received(b)) == [f"after-{i}" for i in range(4)]
    kv = {r.headers["x-request-id"]: r.body["kv_transfer_params"] for r in d.completions()}
    assert kv["on-a"]["remote_engine_id"] == f"engine-{a.port}"
    assert a.frees() == []                        # the decode finished: nothing to free


def test_a_draining_prefill_still_gets_the_free_notice(servers, tmp_path):
    """The decode of a request A prefilled fails after A was removed: the free notice still
    reaches A (its client is open until the request lets go of it), then A goes."""
    a, b, _, d, _ = servers
    a.script = Script(delay_s=0.8)
    d.script = Script(status=500)
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    with running(path) as proxy, ThreadPoolExecutor(1) as pool:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        first = pool.submit(complete, proxy.url, "freed")
        wait_for(lambda: received(a) == ["freed"], CHANGE_S, "A to have the request")
        write(path, prefill=[entry("prefill-1", b)], decode=[entry("decode-0", d)])
        wait_states(proxy, {name(a): "draining", name(b): "active", name(d): "active"})
        status, _ = first.result(timeout=30)
        assert status == 500                      # the decode's answer, as is
        wait_states(proxy, {name(b): "active", name(d): "active"})
        sent = metrics(proxy.url)["kvrelay_proxy:kv_free_notices_total"]
        assert sent[(("result", "sent"),)] == 1
    assert [f.body["remote_request_id"] for f in a.frees()] == ["prefill-freed"]


def test_a_replaced_decode_finishes_its_stream_and_new_ones_go_to_its_successor(servers,
                                                                               tmp_path):
    """decode-0 moves from D to E (a restart elsewhere) while D streams: D's stream ends
    whole, every later request goes to E, then D goes."""
    a, _, _, d, e = servers
    d.script = Script(chunk_delay_s=0.3)
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    with running(path) as proxy, ThreadPoolExecutor(6) as pool:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        first = pool.submit(complete, proxy.url, "on-d", True)
        wait_for(lambda: d.events == ["stream_started"], CHANGE_S, "D to stream")
        write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", e)])
        wait_states(proxy, {name(a): "active", name(d): "draining", name(e): "active"})
        info = metrics(proxy.url)["kvrelay_proxy:backend_info"]
        assert {dict(k)["id"] for k in info if dict(k)["role"] == "decode"} == {"decode-0"}
        later = [pool.submit(complete, proxy.url, f"after-{i}", i % 2 == 1) for i in range(4)]
        assert [f.result(timeout=30) for f in [first, *later]] == [(200, WHOLE)] * 5
        wait_states(proxy, {name(a): "active", name(e): "active"})
    assert received(d) == ["on-d"] and d.events == ["stream_started", "stream_finished"]
    assert sorted(received(e)) == [f"after-{i}" for i in range(4)]


def resume(url: str, response_id: str, leave_after: int | None = None) -> tuple[int, str]:
    """(status, the text) of a stored response's events resumed through the proxy (`GET
    /v1/responses/{id}?stream=true`); `leave_after`: the client leaves after that many."""
    lines: list[str] = []
    with client() as c, c.stream("GET", f"{url}/v1/responses/{response_id}",
                                 params={"stream": "true", "starting_after": "0"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == leave_after:
                    break
    if lines[-1:] != ["data: [DONE]"]:
        return r.status_code, f"stream without [DONE]: {lines}"
    return r.status_code, "".join(json.loads(line[6:])["choices"][0]["text"]
                                  for line in lines[:-1])


def test_a_drained_decode_waits_for_a_resumed_stream(servers, tmp_path):
    """A stored response's resumed stream counts as in flight on the decode server holding
    it: one the client left lets go of it; one still streaming when the file replaces the
    server keeps it (draining) until the stream ends whole; then it goes."""
    a, _, _, d, e = servers
    d.script = Script(chunk_delay_s=0.3)          # a resumed stream: ~1.5 s
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    with running(path) as proxy, ThreadPoolExecutor(1) as pool:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        proxy.state.homes.remember("resp_bg", by_name(proxy.state, d.port))   # as if relayed
        left = resume(proxy.url, "resp_bg", leave_after=1)
        assert left[0] == 200 and "without [DONE]" in left[1]
        wait_for(lambda: "stream_cancelled" in d.events, CHANGE_S, "D's stream to be closed")
        d.events.clear()
        stream = pool.submit(resume, proxy.url, "resp_bg")
        wait_for(lambda: d.events == ["stream_started"], CHANGE_S, "D to stream")
        write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", e)])
        wait_states(proxy, {name(a): "active", name(d): "draining", name(e): "active"})
        assert stream.result(timeout=30) == (200, WHOLE)
        wait_states(proxy, {name(a): "active", name(e): "active"})
    assert d.events == ["stream_started", "stream_finished"]


def test_an_unexpected_error_in_the_decode_leg_lets_the_prefill_go(servers, tmp_path,
                                                                   monkeypatch, caplog):
    """Sending to the decode raises what no path expects (a proxy bug, injected): the client
    gets 502 with an OpenAI error body, the prefill its free notice, and neither server stays
    held: the prefill, then removed from the file, is dropped."""
    a, b, _, d, _ = servers
    post = legs._post

    async def broken_decode(backend, path, payload, headers):
        if backend.role == "decode":
            raise RuntimeError("injected")
        return await post(backend, path, payload, headers)
    monkeypatch.setattr(legs, "_post", broken_decode)
    caplog.set_level(logging.ERROR, logger="kvrelay.proxy")
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    with running(path) as proxy:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        with client() as c:
            r = c.post(f"{proxy.url}/v1/completions", json=BODY, headers={"X-Request-Id": "bug"})
        assert r.status_code == 502 and r.headers["x-request-id"] == "bug"
        assert r.json() == {"error": {"message": "decode leg failed: internal proxy error: "
                                                 "RuntimeError",
                                      "type": "BadGatewayError", "param": None, "code": 502}}
        wait_for(lambda: len(a.frees()) == 1, CHANGE_S, "the free notice to A")
        assert by_name(proxy.state, d.port).in_flight == 0
        write(path, prefill=[entry("prefill-1", b)], decode=[entry("decode-0", d)])
        wait_states(proxy, {name(b): "active", name(d): "active"})
    assert received(a) == ["bug"] and d.completions() == []
    assert [f.body["remote_request_id"] for f in a.frees()] == ["prefill-bug"]
    assert any("internal error opening the decode leg" in r.getMessage() and r.exc_info
               for r in caplog.records)


def test_models_says_why_no_decode_server_answers(servers, tmp_path):
    _, _, _, d, _ = servers
    d.script = Script(health=503)
    path = tmp_path / "backends.json"
    write(path)

    def models(url: str) -> tuple[int, str]:
        with client() as c:
            r = c.get(f"{url}/v1/models")
        return r.status_code, (r.json()["data"][0]["id"] if r.status_code == 200
                               else r.json()["error"]["message"])

    with running(path) as proxy:
        assert models(proxy.url) == (503, "no decode server takes requests (none is listed): "
                                          "try again later")
        write(path, decode=[entry("decode-0", d)])
        wait_states(proxy, {name(d): "unready"})
        assert models(proxy.url) == (503, "no decode server takes requests (1 not ready yet "
                                          "(no healthy /health)): try again later")
        d.script = Script()
        wait_states(proxy, {name(d): "active"})
        assert models(proxy.url) == (200, "fake-model")


def test_an_added_server_waits_for_a_healthy_probe(servers, tmp_path):
    a, b, _, d, _ = servers
    b.script = Script(health=503)
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    with running(path) as proxy:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        write(path, prefill=[entry("prefill-0", a), entry("prefill-1", b)],
              decode=[entry("decode-0", d)])
        wait_states(proxy, {name(a): "active", name(b): "unready", name(d): "active"})
        assert [complete(proxy.url, f"early-{i}") for i in range(3)] == [(200, WHOLE)] * 3
        assert received(b) == []
        counts = metrics(proxy.url)["kvrelay_proxy:backends"]
        assert counts[(("role", "prefill"), ("state", "unready"))] == 1
        b.script = Script()
        wait_states(proxy, {name(a): "active", name(b): "active", name(d): "active"})
        assert [complete(proxy.url, f"late-{i}") for i in range(4)] == [(200, WHOLE)] * 4
    assert len(received(b)) == 2                    # round robin over A and B


def test_a_bad_file_is_logged_once_and_the_servers_stay(servers, tmp_path, caplog):
    a, b, _, d, _ = servers
    path = tmp_path / "backends.json"
    write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
    caplog.set_level(logging.ERROR, logger="kvrelay.proxy")
    with running(path) as proxy:
        wait_states(proxy, {name(a): "active", name(d): "active"})
        write_text(path, '{"prefill": [')
        time.sleep(10 * POLL_S)
        duplicated = [entry("prefill-0", b), entry("prefill-1", b)]
        write(path, prefill=duplicated, decode=[entry("decode-0", d)])
        time.sleep(10 * POLL_S)
        assert states(proxy.url) == {name(a): "active", name(d): "active"}
        assert complete(proxy.url, "kept") == (200, WHOLE)
        problems = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
        assert len(problems) == 2, problems
        assert "not JSON" in problems[0]
        assert f"prefill: url '{b.url}' listed twice" in problems[1]
        write(path, prefill=[entry("prefill-1", b)], decode=[entry("decode-0", d)])
        wait_states(proxy, {name(b): "active", name(d): "active"})
        assert complete(proxy.url, "new") == (200, WHOLE)
    assert received(a) == ["kept"] and received(b) == ["new"]


# -- the file ---------------------------------------------------------------------------------
def test_the_file_format():
    specs = parse(json.dumps({
        "prefill": [{"id": "prefill-0", "url": "http://10.0.0.5:8100", "kv_events_port": 5557,
                     "kv_events_replay_port": 5558},
                    {"id": "prefill-1", "url": "http://[fd00::7]:8100/"}],
        "decode": [{"id": "decode-0", "url": "http://node-b:8200"}]}))
    assert specs == [BackendSpec("prefill", "prefill-0", "10.0.0.5", 8100, 5557, 5558),
                     BackendSpec("prefill", "prefill-1", "fd00::7", 8100),
                     BackendSpec("decode", "decode-0", "node-b", 8200)]
    assert specs[1].url == "http://[fd00::7]:8100" and specs[1].name == "fd00::7:8100"
    assert parse('{"prefill": [], "decode": []}') == []


@pytest.mark.parametrize("doc, message", [
    ("[]", 'not a JSON object {"prefill": [...], "decode": [...]}'),
    ('{"prefill": []}', "decode: a list of servers is needed (it may be empty)"),
    ('{"prefill": [], "decode": [], "prefil": []}', "unknown key 'prefil'"),
    ('{"prefill": ["http://a:1"], "decode": []}', 'prefill[0]: not an object'),
    ('{"prefill": [{"url": "http://a:1"}], "decode": []}', "prefill[0].id: a non-empty"),
    ('{"prefill": [{"id": "p", "url": "https://a:1"}], "decode": []}',
     "prefill[0].url: 'https://a:1' is not \"http://HOST:PORT\""),
    ('{"prefill": [{"id": "p", "url": "http://a"}], "decode": []}', "is not \"http://HOST:PORT\""),
    ('{"prefill": [{"id": "p", "url": "http://a:1/v1"}], "decode": []}', "is not \"http://"),
    ('{"prefill": [{"id": "p", "url": "http://a:99999"}], "decode": []}', "prefill[0].url"),
    ('{"prefill": [{"id": "p", "url": "http://a:1", "port": 2}], "decode": []}',
     "prefill[0]: unknown key 'port'"),
    ('{"prefill": [{"id": "p", "url": "http://a:1", "kv_events_port": true}], "decode": []}',
     "prefill[0].kv_events_port: True is not a TCP port"),
    ('{"prefill": [{"id": "p", "url": "http://a:1", "kv_events_replay_port": 5}], '
     '"decode": []}', "prefill[0].kv_events_replay_port needs kv_events_port"),
    ('{"prefill": [], "decode": [{"id": "d", "url": "http://a:1", "kv_events_port": 5}]}',
     "decode[0].kv_events_port: only prefill servers' KV events are followed"),
    ('{"prefill": [{"id": "p", "url": "http://a:1"}, {"id": "p", "url": "http://a:2"}], '
     '"decode": []}', "prefill: id 'p' listed twice"),
])
def test_a_bad_file_names_its_problem(doc, message):
    with pytest.raises(BackendsFileError) as e:
        parse(doc)
    assert message in str(e.value)


def test_diff_drains_removed_and_moved_ids_and_adds_new_and_moved_ones():
    def spec(role, server_id, port, events=None):
        return BackendSpec(role, server_id, "h", port, events)
    old = [spec("prefill", "p0", 1), spec("prefill", "p1", 2), spec("prefill", "p2", 3, 9),
           spec("decode", "d0", 4)]
    new = [spec("prefill", "p1", 2), spec("prefill", "p2", 3, 8), spec("prefill", "p3", 5),
           spec("decode", "d0", 6)]
    change = diff(old, new)
    assert [s.id for s in change.drained] == ["p0", "d0"]
    assert change.drained[1].port == 4 and change.added[1].port == 6
    assert [s.id for s in change.added] == ["p3", "d0"]
    assert [(s.id, s.kv_events_port) for s in change.updated] == [("p2", 8)]
    assert not diff(new, new)


def test_polling_sees_a_new_version_once(tmp_path, caplog):
    path = tmp_path / "b.json"
    write_text(path, '{"prefill": [], "decode": []}')
    f = BackendsFile(path)
    assert f.current() == [] and f.poll() is None
    write_text(path, '{"prefill": [{"id": "p", "url": "http://h:1"}], "decode": []}')
    assert [s.id for s in f.poll() or []] == ["p"] and f.poll() is None
    caplog.set_level(logging.ERROR, logger="kvrelay.proxy")
    path.unlink()
    assert f.poll() is None and f.poll() is None
    assert len(caplog.records) == 1 and "cannot be read" in caplog.records[0].getMessage()


# -- the state's bookkeeping ------------------------------------------------------------------
def make_state(path: Path, doc: dict[str, Any], routing: RoutingSettings | None = None,
               ) -> proxy_state.ProxyState:
    path.write_text(json.dumps(doc))
    return proxy_state.ProxyState.create([], [], health_interval_s=0, routing=routing,
                                         backends_file=BackendsFile(path))


def healthy_probes(state: proxy_state.ProxyState, monkeypatch) -> None:
    """Every backend answers its probe (no network, no /metrics)."""
    async def healthy(_state, _backend):
        return None

    async def no_scrape(_backend):
        return None
    monkeypatch.setattr(proxy_state, "probe", healthy)
    monkeypatch.setattr(state, "_scrape", no_scrape)


async def admit(state: proxy_state.ProxyState) -> None:
    """One probe of every unready backend: they answer, so they take requests."""
    for b in list(state.backends):
        if not b.ready:
            await state._check(b)


def specs(doc: dict[str, Any]) -> list[BackendSpec]:
    return parse(json.dumps(doc))


def one(server_id: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"id": server_id, "url": f"http://127.0.0.1:{port}", **extra}


def by_name(state: proxy_state.ProxyState, port: int) -> Backend:
    return next(b for b in state.backends if b.port == port)


def test_a_drained_prefill_leaves_the_prefix_table_and_the_metrics(tmp_path, monkeypatch):
    doc = {"prefill": [one("p0", 9101), one("p1", 9102)],
           "decode": [one("d0", 9201)]}
    state = make_state(tmp_path / "b.json", doc)
    healthy_probes(state, monkeypatch)
    asyncio.run(admit(state))
    p0 = by_name(state, 9101)
    key = Hasher().key("/v1/completions", {"model": "m", "prompt": "x" * 400})

    async def scenario() -> None:
        state.record(key, p0)
        state.router(p0).table.set_capacity(p0.name, 100)
        state.acquire(p0)                               # a request in flight on it
        state.apply(specs({"prefill": doc["prefill"][1:], "decode": doc["decode"]}))
        assert [b.name for b in state.prefill_router.backends] == ["127.0.0.1:9102"]
        await asyncio.sleep(0.01)
        assert p0.state == "draining" and p0 in state.prefill
        state.release(p0)                               # it answered: the decode pulls its KV
        state.hold(p0)
        await asyncio.sleep(0.01)
        assert not p0.dropped
        state.let_go(p0)                                # the decode ended
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert p0.dropped and p0 not in state.prefill
    table = state.prefill_router.table
    assert table.blocks(p0.name) == 0 and table.capacity(p0.name) == table.default_capacity
    assert p0.name.encode() not in state.metrics.render()


def test_flag_given_servers_are_active_under_their_address():
    state = proxy_state.ProxyState.create([("127.0.0.1", 9101)], [("127.0.0.1", 9201)])
    families = {f.name: f for f in text_string_to_metric_families(
        state.metrics.render().decode())}
    assert [(s.labels["id"], s.labels["state"]) for s in
            families["kvrelay_proxy:backend_info"].samples] == [("127.0.0.1:9101", "active"),
                                                               ("127.0.0.1:9201", "active")]
    counts = {(s.labels["role"], s.labels["state"]): s.value
              for s in families["kvrelay_proxy:backends"].samples}
    assert counts[("prefill", "active")] == counts[("decode", "active")] == 1
    assert sum(counts.values()) == 2


def test_kv_event_sources_follow_the_file(tmp_path):
    pytest.importorskip("zmq")
    routing = RoutingSettings(kv_events=KVEventsRouting(()))
    doc = {"prefill": [one("p0", 9101)], "decode": [one("d0", 9201)]}
    state = make_state(tmp_path / "b.json", doc, routing)
    assert state.kv_events is None and not state.hasher.token_keys   # nobody publishes yet
    ports = [free_port() for _ in range(3)]

    async def scenario() -> None:
        with_events = {"prefill": [one("p0", 9101),
                                   one("p1", 9102, kv_events_port=ports[0])],
                       "decode": doc["decode"]}
        state.apply(specs(with_events))
        feed = state.kv_events
        assert feed is not None and state.prefill_router.events is feed
        assert state.hasher.token_keys
        feed.start()
        try:
            assert [(s.name, s.endpoint) for s in feed.sources] == [
                ("127.0.0.1:9102", f"tcp://127.0.0.1:{ports[0]}")]
            moved = {"prefill": [one("p0", 9101, kv_events_port=ports[1]),
                                 one("p1", 9102, kv_events_port=ports[2])],
                     "decode": doc["decode"]}
            state.apply(specs(moved))                   # same servers, other event ports
            assert sorted(s.endpoint for s in feed.sources) == [
                f"tcp://127.0.0.1:{p}" for p in sorted(ports[1:])]
            wait_for(lambda: len(feed.subscriber) == 2, CHANGE_S, "the feed to follow both")
            state.apply(specs({"prefill": moved["prefill"][:1], "decode": doc["decode"]}))
            await asyncio.sleep(0.01)                   # p1 drained (idle) and dropped
            assert [s.name for s in feed.sources] == ["127.0.0.1:9101"]
            wait_for(lambda: len(feed.subscriber) == 1, CHANGE_S, "the feed to drop p1")
            assert b"127.0.0.1:9102" not in state.metrics.render()
        finally:
            feed.stop()

    asyncio.run(scenario())


def test_stored_responses_follow_their_server_id(tmp_path, monkeypatch):
    doc = {"prefill": [one("p0", 9101)],
           "decode": [one("d0", 9201), one("d1", 9202)]}
    state = make_state(tmp_path / "b.json", doc)
    healthy_probes(state, monkeypatch)
    asyncio.run(admit(state))
    d0, d1 = by_name(state, 9201), by_name(state, 9202)
    state.homes.remember("resp_a", d0)
    state.homes.remember("resp_b", d1)

    async def scenario() -> None:                       # d0 moves to :9203, d1 is removed
        state.apply(specs({"prefill": doc["prefill"],
                           "decode": [one("d0", 9203)]}))
        assert state.homes.home("resp_a") is None       # its successor is not ready yet...
        state.homes.remember("resp_a", d0)
        await admit(state)
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    moved = by_name(state, 9203)
    assert state.homes.home("resp_a") is moved          # ...then it is
    assert state.homes.home("resp_b") is None and len(state.homes) == 1


# -- flags --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--prefiller-port", "8100"],
     "--backends-file and --prefiller-port: give the servers in one or the other"),
    (["--decoder-host", "h"],
     "--backends-file and --decoder-host: give the servers in one or the other"),
    (["--health-interval", "0"], "--backends-file needs the background probe"),
    (["--kv-events-port", "5557"], "--kv-events-port: with --backends-file, give each prefill "
                                   "server's kv_events_port in the file"),
])
def test_flag_conflicts_are_one_line_errors(tmp_path, capsys, extra, message):
    path = tmp_path / "b.json"
    write(path)
    assert main(["--backends-file", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrelay proxy: error: {message}") and err.count("\n") == 1


def test_a_missing_or_bad_file_at_start_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["--backends-file", str(path)]) == 2
    assert capsys.readouterr().err == (f"kvrelay proxy: error: --backends-file: {path}: No such "
                                       "file or directory\n")
    write_text(path, '{"prefill": [], "decode": [{"id": "d", "url": "http://h"}]}')
    assert main(["--backends-file", str(path)]) == 2
    assert capsys.readouterr().err == (f"kvrelay proxy: error: --backends-file: {path}: "
                                       "decode[0].url: 'http://h' is not \"http://HOST:PORT\"\n")


# -- e2e: a real proxy process ------------------------------------------------------------------
def test_a_proxy_process_follows_the_file(servers, tmp_path):
    """`kvrelay proxy --backends-file` as a process: started with no prefill server (503),
    then C and D listed, then C replaced by A while requests keep coming: all 200."""
    a, _, c, d, _ = servers
    path = tmp_path / "backends.json"
    write(path, decode=[entry("decode-0", d)])
    proxy = ProxyProcess(["--port", str(free_port()), "--backends-file", str(path),
                          "--health-interval", "0.2", "--routing", "round_robin"],
                         tmp_path / "proxy.log")
    try:
        proxy.wait_ready()
        wait_for(lambda: states(proxy.url) == {name(d): "active"}, CHANGE_S, "D active")
        assert complete(proxy.url, "none")[0] == 503
        write(path, prefill=[entry("prefill-0", c)], decode=[entry("decode-0", d)])
        wait_for(lambda: states(proxy.url) == {name(c): "active", name(d): "active"},
                 CHANGE_S, "C active")
        c.script = Script(delay_s=0.5)
        with ThreadPoolExecutor(4) as pool:
            before = [pool.submit(complete, proxy.url, f"c-{i}", i == 0) for i in range(2)]
            wait_for(lambda: len(received(c)) == 2, CHANGE_S, "C to have both")
            write(path, prefill=[entry("prefill-0", a)], decode=[entry("decode-0", d)])
            wait_for(lambda: states(proxy.url).get(name(a)) == "active", CHANGE_S, "A active")
            after = [pool.submit(complete, proxy.url, f"a-{i}", i == 1) for i in range(2)]
            assert [f.result(timeout=30) for f in before + after] == [(200, WHOLE)] * 4
        wait_for(lambda: states(proxy.url) == {name(a): "active", name(d): "active"},
                 CHANGE_S, "C dropped")
        assert sorted(received(c)) == ["c-0", "c-1"] and sorted(received(a)) == ["a-0", "a-1"]
        assert "prefill server 127.0.0.1:" in proxy.log() and "drained: no longer used" in \
            proxy.log()
    finally:
        proxy.stop()

