"""A live `kvrelay serve` on the tiny checkpoint (vocabulary 160) against hostile and
careless clients: every request the issue found to kill the engine or answer 500 is a
400 naming the field (or served, where vLLM serves it), one request's failure inside a
step fails that request only, and every error is OpenAI's error object."""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading

import httpx
import pytest

from tests.faults import ADD_FAULT, SAMPLE_FAULT
from tests.processes import Server

OK = {"model": "tiny", "prompt": "w5 w17 w29", "max_tokens": 4}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
                              "--served-model-name", "tiny", "--max-logprobs", "5",
                              "--logits-processors", "tests.faults:inject"],
               tmp_path_factory.mktemp("hardening") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def post(server: Server, body: dict | None = None, path: str = "/v1/completions",
         **kwargs) -> httpx.Response:
    if body is not None:
        kwargs["json"] = body
    kwargs.setdefault("headers", {}).setdefault("content-type", "application/json")
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == status and isinstance(body["error"]["message"], str)
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


def assert_serves(server: Server) -> None:
    """The server is alive and answers an ordinary request in full."""
    r = post(server, OK | {"temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("change,param", [
    ({"stop_token_ids": [5000], "min_tokens": 2}, "stop_token_ids"),      # killed the engine
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": [[5, 17], [5, 99999]]}, "prompt"),                        # was 500
    ({"prompt": [5, -3]}, "prompt"),
    ({"logit_bias": {"5000": 10}}, "logit_bias"),                          # was accepted
    ({"logit_bias": {"w5": 10}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),                                           # was silently ignored
    ({"min_tokens": 10}, "min_tokens"),
    ({"logprobs": 6}, "logprobs"),
    ({"seed": 2 ** 70}, "seed"),                                           # was an overflow message
    ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_fields_are_400_naming_the_field(server, change, param):
    assert_openai_error(post(server, OK | change), 400, param)
    assert_serves(server)


def test_chat_top_logprobs_over_the_limit_names_top_logprobs(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "logprobs": True,
            "top_logprobs": 6}
    assert_openai_error(post(server, body, "/v1/chat/completions"), 400, "top_logprobs")


def test_lone_surrogates_are_400_naming_the_field(server):
    raw = b'{"model": "tiny", "prompt": "w5 \\ud800", "max_tokens": 4}'
    assert_openai_error(post(server, content=raw), 400, "prompt")
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "w5 \\udfff w6"}]}'
    assert_openai_error(post(server, path="/v1/chat/completions", content=raw), 400,
                        "messages.0.content")
    # a valid pair is text
    ok = b'{"model": "tiny", "prompt": "w5 \\ud83d\\ude00", "max_tokens": 2}'
    r = post(server, content=ok)
    assert r.status_code == 200, r.text
    assert_serves(server)


def test_top_k_beyond_the_vocabulary_is_off_as_in_vllm(server):
    """vLLM clamps top_k >= vocabulary size to the vocabulary (keep every token); it
    killed the engine here. Same seed: the same tokens as top_k off."""
    sampled = OK | {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    big = post(server, sampled | {"top_k": 1000})
    off = post(server, sampled | {"top_k": -1})
    assert big.status_code == off.status_code == 200, big.text
    assert big.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
    assert_serves(server)


def test_temperature_below_epsilon_is_greedy(server):
    """1e-45 divided the logits into inf/NaN (token 0 every time); vLLM treats any
    temperature below 1e-5 as greedy."""
    greedy = OK | {"max_tokens": 8, "ignore_eos": True}
    tiny_t = post(server, greedy | {"temperature": 1e-45}).json()["choices"][0]["text"]
    zero = post(server, greedy | {"temperature": 0}).json()["choices"][0]["text"]
    assert tiny_t == zero


def test_logit_bias_in_the_vocabulary_is_applied(server):
    r = post(server, OK | {"max_tokens": 5, "temperature": 0, "ignore_eos": True,
                           "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].split() == ["w42"] * 5


def test_one_request_failing_inside_a_step_fails_alone(server):
    """A request whose sampling raises (scripted fault) gets a 500 while requests in the
    same batches complete in full, and the engine keeps serving."""
    long = {"model": "tiny", "prompt": "w5 w17 w29", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(post(server, long)))
               for _ in range(3)]
    for t in threads:
        t.start()
    faulty = post(server, OK | {"prompt": [SAMPLE_FAULT, 5, 17]})
    streamed = httpx.post(f"{server.url}/v1/completions",
                          json=OK | {"prompt": [SAMPLE_FAULT, 6], "stream": True}, timeout=60)
    for t in threads:
        t.join()
    error = assert_openai_error(faulty, 500)
    assert error["type"] == "InternalServerError"
    assert "injected fault while sampling" in error["message"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["code"] == 500
    assert [r.status_code for r in results] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in results)
    assert_serves(server)
    assert server.metrics()["kvrelay:kv_blocks_used"] == 0


def test_a_request_failing_while_added_fails_alone(server):
    error = assert_openai_error(post(server, OK | {"prompt": [ADD_FAULT, 5]}), 500)
    assert "injected fault while adding" in error["message"]
    assert_serves(server)


def test_concurrent_requests_with_one_request_id_all_succeed(server):
    """Gateways retry with one X-Request-Id: 4 at once used to 400 (or, on a prefill,
    crash the engine); the id is still echoed."""
    body = OK | {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: post(server, body, headers={"X-Request-Id": "retry-7"}),
                           range(4)))
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert {r.json()["id"] for r in rs} == {"cmpl-retry-7"}
    assert {r.headers["x-request-id"] for r in rs} == {"retry-7"}
    assert len({r.json()["choices"][0]["text"] for r in rs}) == 1


DEEP = b'{"model": "tiny", "prompt": "w5", "x": ' + b"[" * 900 + b"]" * 900 + b"}"


@pytest.mark.parametrize("method,path,content,status", [
    ("GET", "/no/such/path", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/models", b"{}", 405),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', 400),
    ("POST", "/v1/completions", DEEP, 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "w5", "temperature": NaN}', 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "w5", "top_p": Infinity}', 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "w5", "temperature": 1e999}', 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "w5 \xff\xfe"}', 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "w5", "max_tokens": "many"}', 400),
    ("POST", "/v1/completions", b"[]", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400),
])
def test_every_error_is_an_openai_error_body(server, method, path, content, status):
    r = httpx.request(method, f"{server.url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json"})
    assert_openai_error(r, status)
    assert "detail" not in r.text


def test_a_body_over_the_limit_is_413_by_content_length(server):
    r = post(server, content=b"x" * (32 * 1024 * 1024 + 1))
    assert_openai_error(r, 413)


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_chunked_body_is_limited_as_it_streams(server):
    """Transfer-Encoding: chunked has no Content-Length: the limit counts bytes as they
    arrive (413), and the API process never holds much more than the limit."""
    before = _peak_rss(server.proc.pid)
    chunk = b"x" * (1 << 20)
    r = httpx.post(f"{server.url}/v1/completions", content=(chunk for _ in range(128)), timeout=60)
    assert_openai_error(r, 413)
    grown = _peak_rss(server.proc.pid) - before
    assert grown < 48 * 1024 * 1024, f"peak RSS grew {grown / 2**20:.0f} MiB for a 128 MiB body"
    assert_serves(server)
