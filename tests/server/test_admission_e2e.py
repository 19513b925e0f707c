"""Bounded admission and forwarded-header trust with a real `kvrelay serve` (tiny checkpoint,
one sequence running and one queued at most) and two `kvrelay proxy`s in front of it:

- one request of too many sequences: 400 naming the field;
- a full queue: 503 with Retry-After and an OpenAI error body, from the server, through a
  proxy's decode leg (as a 503, not a 500) and through its prefill leg (busy: retried,
  then answered as is); the admitted requests finish whole and every KV block comes back;
- X-Forwarded-For from 127.0.0.1 is not trusted unless --forwarded-allow-ips names it.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
from tests.processes import KvrelayProcess, Server, free_port, stop_all

LONG = 1900                        # tokens (seconds here): the running request outlives the checks
SHORT = 8
SPOOFED = "203.0.113.77"           # TEST-NET-3: no real client has it


@pytest.fixture(scope="module")
def bounded(tiny, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "2048", "--block-size", "4",
                              "--max-num-seqs", "1", "--max-queued-requests", "1",
                              "--max-seqs-per-request", "4"],
               tmp_path_factory.mktemp("bounded") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


class Proxy(KvrelayProcess):
    def __init__(self, backend_port: int, extra: list[str], log) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["proxy", "--port", str(self.port), "--prefiller-port", str(backend_port),
                          "--decoder-port", str(backend_port), "--health-interval", "0", *extra],
                         log)


@pytest.fixture(scope="module")
def proxies(bounded, tmp_path_factory) -> Iterator[tuple[Proxy, Proxy]]:
    """(straight to decode, trusting 127.0.0.1's forwarded headers; prefill then decode,
    retrying a busy prefill for 0.2 s, trusting nobody's)."""
    logs = tmp_path_factory.mktemp("proxies")
    made: list[Proxy] = []
    try:
        made.append(Proxy(bounded.port, ["--disagg-policy", "never",
                                         "--forwarded-allow-ips", "127.0.0.1"],
                          logs / "decode.log"))
        made.append(Proxy(bounded.port, ["--prefill-busy-retry", "0.2"], logs / "prefill.log"))
        for p in made:
            p.wait_for_line("Application startup complete", 60)
        yield made[0], made[1]
    finally:
        stop_all(made)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def _short(url: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions",
                      json={"prompt": [5, 6, 7], "max_tokens": 2, **extra}, timeout=60)


def _wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["kvrelay:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_too_many_sequences_in_one_request_is_400(bounded):
    r = _short(bounded.url, prompt=[[5, 6]] * 3, n=2)
    error = _error(r, 400)
    assert error["param"] == "prompt" and "--max-seqs-per-request 4" in error["message"]
    assert _error(_short(bounded.url, n=5), 400)["param"] == "n"
    r = _short(bounded.url, prompt=[[5, 6]] * 2, n=2)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def _stream_body(tokens: int) -> dict:
    return {"prompt": [5, 6, 7, 8], "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def _read_to_end(lines: Iterator[str]) -> tuple[int, list[str]]:
    """(completion tokens in the usage chunk, finish reasons) of an SSE completion's lines."""
    usage, reasons = 0, []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
    return usage, reasons


def test_a_full_queue_is_503_and_the_admitted_requests_finish(bounded, proxies):
    through_decode, through_prefill = proxies
    idle = _wait_idle(bounded)
    assert idle["kvrelay:kv_blocks_free"] == idle["kvrelay:kv_blocks_total"]
    with httpx.Client(timeout=120) as a, httpx.Client(timeout=120) as b, \
            a.stream("POST", f"{bounded.url}/v1/completions", json=_stream_body(LONG)) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))   # it runs
        # headers back: the handler admitted it; it waits (--max-num-seqs 1)
        with b.stream("POST", f"{bounded.url}/v1/completions", json=_stream_body(SHORT)) as queued:
            assert queued.status_code == 200
            refused = _short(bounded.url)
            error = _error(refused, 503)
            assert error["type"] == "ServiceUnavailableError"
            assert "--max-queued-requests 1" in error["message"]
            assert refused.headers["Retry-After"] == "1"
            busy = bounded.metrics()
            assert busy["kvrelay:admission_queued_sequences"] == 1
            assert busy["kvrelay:requests_refused_queue_full_total"] == 1
            streamed = _short(bounded.url, stream=True)
            assert _error(streamed, 503)["type"] == "ServiceUnavailableError"
            # a decode server's 503 reaches the proxy's client as it is
            via_decode = _short(through_decode.url)
            assert _error(via_decode, 503)["message"] == error["message"]
            assert via_decode.headers["Retry-After"] == "1"
            # a prefill's 503 is "busy": retried for --prefill-busy-retry, then answered as is
            via_prefill = _short(through_prefill.url)
            assert _error(via_prefill, 503)["message"] == error["message"]
            assert via_prefill.headers["Retry-After"] == "1"
            assert _read_to_end(queued.iter_lines()) == (SHORT, ["length"])
        assert _read_to_end(lines) == (LONG, ["length"])
    retries = httpx.get(f"{through_prefill.url}/metrics").text
    assert re.search(r'kvrelay_proxy:prefill_busy_retries_total\{[^}]*\} [1-9]', retries)
    m = _wait_idle(bounded)
    assert m["kvrelay:kv_blocks_free"] == m["kvrelay:kv_blocks_total"] == idle[
        "kvrelay:kv_blocks_total"]
    assert _short(bounded.url).status_code == 200           # room again


def _peer_logged(process: KvrelayProcess, url: str) -> str:
    """The client address the process's access log shows for one request carrying a spoofed
    X-Forwarded-For."""
    marker = uuid.uuid4().hex
    httpx.get(f"{url}/health?probe={marker}", headers={"X-Forwarded-For": SPOOFED})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in process.log().splitlines():
            if marker in line:
                return line.split(" - ")[0].split()[-1].rsplit(":", 1)[0]
        time.sleep(0.1)
    raise AssertionError(f"no access log line for the probe:\n{process.log()[-2000:]}")


def test_forwarded_for_is_trusted_only_when_the_operator_opts_in(bounded, proxies):
    trusting, default = proxies
    assert _peer_logged(bounded, bounded.url) == "127.0.0.1"
    assert _peer_logged(default, default.url) == "127.0.0.1"
    assert _peer_logged(trusting, trusting.url) == SPOOFED


def test_serve_trusts_forwarded_for_from_the_addresses_it_is_given(server):
    """The package's server (tests/server/conftest.py) runs with --forwarded-allow-ips
    127.0.0.1."""
    assert _peer_logged(server, server.url) == SPOOFED
