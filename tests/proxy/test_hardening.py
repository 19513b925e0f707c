"""The proxy under hostile or careless clients and failing backends (issue 11): no re-sending
of answered requests, its own API key, 499 for clients that leave, OpenAI error bodies for
every refusal, health-probe routing, kv_transfer_params passed through untouched."""
from __future__ import annotations

import time

import pytest

from tests.proxy.conftest import BACKEND_KEY, PROXY_KEY
from tests.proxy.fakes import client, kv_params_of, wait_for
from tests.proxy.test_relay import _samples, served_by

BODY = {"prompt": "x", "max_tokens": 3}


def assert_openai_error(r, status: int, type_: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    if type_:
        assert error["type"] == type_
    return error


def prefill_attempts(fakes) -> int:
    return sum(len(f.completions()) for f in fakes.prefill)


# ------------------------------------------------------------------ answered means done

@pytest.mark.parametrize("status", [400, 422, 500, 502, 503])
def test_an_answered_prefill_request_is_never_sent_to_another_prefill(fakes, proxies, status):
    for f in fakes.prefill:
        f.script.status = status
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", json=BODY,
                   headers={"X-Request-Id": f"ans-{status}"})
    assert r.status_code == status
    # the backend's own body
    assert r.json()["error"]["message"] == f"scripted {status} from prefill"
    assert r.headers["x-request-id"] == f"ans-{status}"
    assert prefill_attempts(fakes) == 1
    assert fakes.decode.completions() == []


def test_a_refused_connection_is_retried_on_the_next_prefill(fakes, proxies):
    a = fakes.prefill[0]
    with client() as c:                       # 'skipping': [refused, A]; round-robin starts on each
        for i in range(2):
            r = c.post(f"{proxies['skipping'].url}/v1/completions", json=BODY,
                       headers={"X-Request-Id": f"rt-{i}"})
            assert r.status_code == 200, r.text
    assert len(a.completions()) == 2
    dead = f"127.0.0.1:{fakes.refused[0]}"
    assert _samples(proxies["skipping"])[("kvrelay_proxy:backend_failures_total",
                                          (("backend", dead), ("reason", "connect"),
                                           ("role", "prefill")))] >= 1


def test_a_prefill_answer_broken_mid_body_is_502_and_not_retried(fakes, proxies):
    for f in fakes.prefill:
        f.script.mode = "break_body"
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", json=BODY)
    error = assert_openai_error(r, 502, "BadGatewayError")
    assert "broke off its answer" in error["message"]
    assert prefill_attempts(fakes) == 1 and fakes.decode.completions() == []


def test_unhealthy_prefill_gets_no_requests(fakes, proxies):
    sick = fakes.prefill[1]
    label = ("kvrelay_proxy:backend_healthy",
             (("backend", f"127.0.0.1:{sick.port}"), ("role", "prefill")))
    sick.script.health = 503
    try:
        wait_for(lambda: _samples(proxies["main"])[label] == 0,
                 what="the probe to mark it unhealthy")
        with client() as c:
            for _ in range(4):
                assert c.post(f"{proxies['main'].url}/v1/completions", json=BODY).status_code == 200
        assert sick.completions() == []
        assert sum(len(f.completions()) for f in fakes.prefill) == 4
    finally:
        sick.script.health = 200
        wait_for(lambda: _samples(proxies["main"])[label] == 1,
                 what="the probe to see it healthy again")


# ------------------------------------------------------------------ kv_transfer_params

def test_prefill_kv_transfer_params_reach_decode_unchanged_with_unknown_keys(fakes, proxies):
    extra = {"kvrelay_capability": "cap-7f3a", "future": {"nested": [1, {"x": None}], "flag": True}}
    for f in fakes.prefill:
        f.script.extra_kv = extra
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", json=BODY,
                   headers={"X-Request-Id": "req-cap"})
    assert r.status_code == 200
    prefill = served_by(fakes, "req-cap")
    [d] = fakes.decode.completions()
    assert d.body["kv_transfer_params"] == kv_params_of(prefill, "req-cap") | extra


# ------------------------------------------------------------------ API key

def test_proxy_key_required_on_v1(fakes, proxies):
    url = proxies["keyed"].url
    with client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": PROXY_KEY},
                        {"Authorization": f"Bearer {BACKEND_KEY}"}):
            error = assert_openai_error(c.post(f"{url}/v1/completions", json=BODY, headers=headers),
                                        401, "AuthenticationError")
            assert PROXY_KEY not in error["message"]
            assert_openai_error(c.get(f"{url}/v1/models", headers=headers), 401)
        assert c.get(f"{url}/health").status_code == 200            # probes stay open, as on vLLM
        assert c.get(f"{url}/metrics").status_code == 200
    assert prefill_attempts(fakes) == 0 and fakes.decode.completions() == []


def test_authenticated_client_reaches_backends_with_the_backend_key(fakes, proxies):
    with client() as c:
        r = c.post(f"{proxies['keyed'].url}/v1/completions", json=BODY, headers={
            "Authorization": f"Bearer {PROXY_KEY}", "X-Request-Id": "req-keyed"})
    assert r.status_code == 200, r.text
    [d] = fakes.decode.completions()
    [p] = served_by(fakes, "req-keyed").completions()
    assert p.headers["authorization"] == d.headers["authorization"] == f"Bearer {BACKEND_KEY}"


def test_backend_key_is_never_lent_to_keyless_clients(fakes, proxies):
    """Without --api-key the proxy authenticates nobody, so $OPENAI_API_KEY stays its own."""
    url = proxies["open_with_backend_key"].url
    with client() as c:
        assert c.post(f"{url}/v1/completions", json=BODY,
                      headers={"X-Request-Id": "req-open"}).status_code == 200
        assert c.post(f"{url}/v1/completions", json=BODY,
                      headers={"X-Request-Id": "req-own",
                               "Authorization": "Bearer client-own"}).status_code == 200
    seen = {r.headers["x-request-id"]: r.headers.get("authorization")
            for f in (fakes.prefill[0], fakes.decode) for r in f.completions()}
    assert seen == {"req-open": None, "req-own": "Bearer client-own"}
    log = proxies["open_with_backend_key"].log()
    assert "OPENAI_API_KEY is set but the proxy has no --api-key" in log


def test_api_key_from_the_environment(monkeypatch):
    from kvrelay.proxy.main import build_parser, settings_from_args
    monkeypatch.delenv("KVRELAY_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert settings_from_args(build_parser().parse_args([])).api_key == "from-vllm-env"
    monkeypatch.setenv("KVRELAY_API_KEY", "from-kvrelay-env")
    assert settings_from_args(build_parser().parse_args([])).api_key == "from-kvrelay-env"
    assert settings_from_args(build_parser().parse_args(["--api-key", "flag"])).api_key == "flag"


# ------------------------------------------------------------------ 499

def test_client_leaving_mid_stream_is_counted_as_499(fakes, proxies):
    fakes.decode.script.mode = "slow_stream"
    proxy = proxies["main"]
    label = ("kvrelay_proxy:requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
    before = _samples(proxy).get(label, 0)
    with client() as c, c.stream("POST", f"{proxy.url}/v1/completions",
                                 json=BODY | {"stream": True},
                                 headers={"X-Request-Id": "req-leaves"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())                  # one event, then hang up
    wait_for(lambda: _samples(proxy).get(label, 0) == before + 1, what="a 499 in the metrics")
    line = "request req-leaves: client closed the connection mid-stream (499)"
    wait_for(lambda: line in proxy.log(), what="the 499 log line")
    ok = ("kvrelay_proxy:requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    count = _samples(proxy).get(ok, 0)
    time.sleep(0.3)
    assert _samples(proxy).get(ok, 0) == count          # not also counted as a 200


# ------------------------------------------------------------------ error bodies

DEEP = ('{"prompt": ' + "[" * 900 + "]" * 900 + ', "max_tokens": 3}').encode()


@pytest.mark.parametrize("raw, fragment", [
    (DEEP, "nested deeper than"),
    (b'{"prompt": "x", "max_tokens": 3, "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "max_tokens": 3, "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "x", "max_tokens": 3, "temperature": -Infinity}', "-Infinity"),
    (b'{"prompt": "x", "max_tokens": 3, "top_p": 1e999}', "out of range"),
    (b'{"prompt": "\\ud800", "max_tokens": 3}', "surrogate"),
    (b'{"prompt": "x", "\\udfff": 1}', "surrogate"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 3}', "UTF-8"),
    (b'{not json', "malformed JSON"),
    (b'[1, 2]', "JSON object"),
    (b'', "malformed JSON"),
], ids=["deep-900", "nan", "inf", "-inf", "1e999", "lone-surrogate", "surrogate-key", "bad-utf8",
        "malformed", "not-object", "empty"])
def test_bad_bodies_are_400_openai_errors(fakes, proxies, raw, fragment):
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/chat/completions", content=raw,
                   headers={"Content-Type": "application/json"})
    error = assert_openai_error(r, 400, "BadRequestError")
    assert fragment in error["message"]
    assert prefill_attempts(fakes) == 0


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens"),
    (b'{"prompt": [1, 2, ' + b"7" * 5001 + b'], "max_tokens": 3}', "prompt.2"),
    (b'{"prompt": "x", "logit_bias": {"5": -' + b"7" * 5001 + b"}}", "logit_bias.5"),
], ids=["max_tokens", "token-id", "logit_bias"])
def test_integers_of_5000_digits_are_400_naming_the_field(fakes, proxies, raw, param):
    """Python's int() refuses over 4,300 digits: before issue 26 that was a 500."""
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", content=raw,
                   headers={"Content-Type": "application/json"})
    error = assert_openai_error(r, 400, "BadRequestError")
    assert error["param"] == param
    assert error["message"] == (f"{param}: an integer of 5001 digits is out of range "
                                f"(at most 100 digits)")
    assert prefill_attempts(fakes) == 0


def test_large_bodies_are_parsed_off_the_loop_with_the_same_checks(fakes, proxies):
    """A body over INLINE_PARSE_BYTES goes through `parse_body` on a worker thread: the same
    checks (path-named 400s), the same forwarded body."""
    from kvrelay.proxy.body import INLINE_PARSE_BYTES
    pad = "a" * (INLINE_PARSE_BYTES + 1)
    bad = ('{"prompt": "x", "pad": "' + pad + '", "max_tokens": 1' + "7" * 5001 + "}").encode()
    good = ('{"prompt": "' + pad + '", "max_tokens": 3}').encode()
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", content=bad,
                   headers={"Content-Type": "application/json"})
        assert assert_openai_error(r, 400, "BadRequestError")["param"] == "max_tokens"
        r = c.post(f"{proxies['main'].url}/v1/completions", content=b"[" + good + b"]",
                   headers={"Content-Type": "application/json"})
        assert "must be a JSON object" in assert_openai_error(r, 400, "BadRequestError")["message"]
        assert prefill_attempts(fakes) == 0
        r = c.post(f"{proxies['main'].url}/v1/completions", content=good,
                   headers={"X-Request-Id": "req-large"})
    assert r.status_code == 200, r.text
    [p] = served_by(fakes, "req-large").completions()
    assert p.body["prompt"] == pad


@pytest.mark.parametrize("what, item", [("tools", '{"type": "function"}'), ("strings", '"x"')])
def test_a_body_of_too_many_objects_or_strings_is_refused_before_the_parse(fakes, proxies,
                                                                           what, item):
    """200,000 tools parsed into 14x their bytes of Python objects in the proxy (the hostile
    battery); the raw-byte shape check refuses such a body first."""
    raw = ('{"messages": [], "tools": [' + ", ".join([item] * 300_000) + "]}").encode()
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/chat/completions", content=raw,
                   headers={"Content-Type": "application/json"})
    error = assert_openai_error(r, 400, "BadRequestError")
    assert "JSON arrays and objects" in error["message"] or "JSON strings" in error["message"]
    assert prefill_attempts(fakes) == 0


def test_surrogate_pair_and_moderate_nesting_pass(fakes, proxies):
    raw = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 3, "x": ' + b"[" * 60 + b"]" * 60 + b"}"
    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", content=raw,
                   headers={"X-Request-Id": "req-emoji"})
    assert r.status_code == 200, r.text
    [p] = served_by(fakes, "req-emoji").completions()
    assert p.body["prompt"] == "\U0001F600"


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/nope", 404), ("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/chat/completions", 405), ("POST", "/health", 405)])
def test_unknown_paths_and_methods_are_openai_errors(proxies, method, path, status):
    with client() as c:
        assert_openai_error(c.request(method, f"{proxies['main'].url}{path}"), status)


def test_chunked_body_over_the_limit_is_413_as_it_streams(fakes, proxies):
    from kvrelay.http_body import MAX_BODY_BYTES
    chunk = b" " * 2**20
    sent = 0

    def body():
        nonlocal sent
        yield b'{"prompt": "'
        while sent < MAX_BODY_BYTES + 8 * 2**20:       # the proxy stops reading long before the end
            sent += len(chunk)
            yield chunk
        yield b'"}'

    with client() as c:
        r = c.post(f"{proxies['main'].url}/v1/completions", content=body(),
                   headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers            # really chunked
    assert_openai_error(r, 413, "RequestTooLarge")
    assert prefill_attempts(fakes) == 0
