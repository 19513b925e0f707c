"""The API server's door (`kvrelay/http_body.py` over ASGI), without a server: streaming
size limit, UTF-8, JSON constants and ranges, integers of any length, nesting depth, lone
surrogates (with the field's path)."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay import http_body
from kvrelay.http_body import MAX_INT_DIGITS, MAX_JSON_DEPTH, BodyError, asgi_chunks, read_limited


def check_json(raw: bytes) -> BodyError | None:
    try:
        http_body.parse_json(raw)
    except BodyError as e:
        return e
    return None


def read_body(receive, limit: int):
    return read_limited(asgi_chunks(receive), limit)


def nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "w1 \\ud800"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', "messages.0.content"),
    (b'{"kv_transfer_params": {"\\ud800": 1}}', "kv_transfer_params.\\ud800"),
])
def test_lone_surrogates_name_their_path(raw, param):
    error = check_json(raw)
    assert error is not None and error.status == 400 and error.param == param


@pytest.mark.parametrize("raw,words", [
    (b'{"t": NaN}', "NaN"), (b'{"t": -Infinity}', "Infinity"), (b'{"t": 1e400}', "out of range"),
    (b'{"p": "\xc3\x28"}', "UTF-8"), (b'{"p": ', "malformed JSON"),
    (nested(MAX_JSON_DEPTH + 1), "deeper"),
    (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper"),
])
def test_bad_bodies_are_400(raw, words):
    error = check_json(raw)
    assert error is not None and error.status == 400 and words in error.message


@pytest.mark.parametrize("raw", [
    nested(MAX_JSON_DEPTH), b'{"p": "w1 \\ud83d\\ude00"}', b'{"p": "\\\\ud800"}', b"",
    b'{"p": [[1, 2]]}',
    b'{"x": 1e300, "y": -0.0}',
])
def test_good_bodies_pass(raw):
    if raw:                                  # the server leaves an empty body to FastAPI
        assert check_json(raw) is None


def test_read_body_stops_at_the_limit_as_bytes_arrive():
    """A chunked body is refused once it passes the limit: the rest is never received."""
    chunk, received = b"x" * 1024, []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": chunk, "more_body": True}   # never ends

    with pytest.raises(BodyError) as e:
        asyncio.run(read_body(receive, limit=10 * 1024))
    assert e.value.status == 413 and len(received) == 11


def test_replay_gives_the_body_then_the_client():
    async def receive():
        return {"type": "http.disconnect"}

    async def run():
        again = http_body.replay(b"{}", receive)
        return await again(), await again()
    first, second = asyncio.run(run())
    assert first == {"type": "http.request", "body": b"{}", "more_body": False}
    assert second == {"type": "http.disconnect"}


class _ReadyEngine:
    """Ready and alive; never reached by the bodies below (the door refuses them)."""

    def __init__(self) -> None:
        self.ready, self.dead, self.info = asyncio.Event(), None, {}
        self.ready.set()


def test_a_surrogate_key_is_a_400_whose_body_is_text():
    """The field path shows the key escaped: a raw lone surrogate in the error body could
    not be encoded as UTF-8, and the client got no OpenAI error at all."""
    from starlette.testclient import TestClient

    from kvrelay.server.api import ServerState, build_app
    state = ServerState(engine=_ReadyEngine(), tokenizer=None,  # type: ignore[arg-type]
                        served_names=["m"], max_model_len=96, max_logprobs=5)
    client = TestClient(build_app(state), raise_server_exceptions=False)
    raw = b'{"prompt": [5], "kv_transfer_params": {"\\ud800": 1}}'
    r = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params.\\ud800" and error["code"] == 400
    assert "lone UTF-16 surrogate (\\ud800)" in error["message"]


# -- integers of any length (issue 26): a 400 naming the field, never Python's ValueError --

HUGE = b"1" + b"0" * 5000                 # past Python's 4,300-digit int() limit


@pytest.mark.parametrize("raw, param, digits", [
    (b'{"max_tokens": ' + HUGE + b"}", "max_tokens", 5001),
    (b'{"prompt": [[5, 6], [7, ' + HUGE + b"]]}", "prompt.1.1", 5001),
    (b'{"seed": -' + b"9" * 4400 + b"}", "seed", 4400),
    (b'{"logit_bias": {"5": ' + b"1" * (MAX_INT_DIGITS + 1) + b"}}", "logit_bias.5",
     MAX_INT_DIGITS + 1),
    (b'{"messages": [{"role": "user", "content": "hi", "x": [' + HUGE + b"]}]}",
     "messages.0.x.0", 5001),
    (HUGE, None, 5001),
])
def test_over_long_integers_are_400_naming_their_path(raw, param, digits):
    error = check_json(raw)
    assert error is not None and error.status == 400 and error.param == param
    assert error.message == (f"{param or 'the body'}: an integer of {digits} digits is out of "
                             f"range (at most {MAX_INT_DIGITS} digits)")


@pytest.mark.parametrize("raw, value", [
    (b'{"n": ' + b"9" * MAX_INT_DIGITS + b"}", {"n": int("9" * MAX_INT_DIGITS)}),
    (b'{"n": -' + b"9" * MAX_INT_DIGITS + b"}", {"n": -int("9" * MAX_INT_DIGITS)}),
    (b'{"p": "' + b"7" * 6000 + b'"}', {"p": "7" * 6000}),          # digits in a string
    (b'{"t": 0.' + b"5" * 6000 + b"}", {"t": 0.5555555555555556}),    # a float, not an int
    (b'{"prompt": [1, 2, 3], "seed": 9223372036854775807}',
     {"prompt": [1, 2, 3], "seed": 2**63 - 1}),
])
def test_integers_up_to_the_bound_and_long_digit_runs_elsewhere_pass(raw, value):
    assert http_body.parse_json(raw) == value


def test_a_megabyte_integer_is_refused_fast():
    import time
    raw = b'{"max_tokens": ' + b"7" * 2**20 + b"}"
    started = time.perf_counter()
    error = check_json(raw)
    assert error is not None and error.param == "max_tokens"
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "m", "prompt": [5], "max_tokens": ' + HUGE + b"}"),
    ("/v1/completions", b'{"model": "m", "prompt": [5, ' + HUGE + b"]}"),
    ("/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": ' + HUGE + b"}"),
    ("/v1/responses", b'{"model": "m", "input": "x", "max_output_tokens": ' + HUGE + b"}"),
    ("/v1/kv_transfer/free", b'{"remote_request_id": ' + HUGE + b"}"),
])
def test_the_server_answers_a_huge_integer_with_a_400_openai_error(path, body):
    """Before: Python's int() limit raised inside the door, and the client got a 500."""
    r = _server_client().post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "an integer of 5001 digits is out of range" in error["message"]
    assert error["param"] in ("max_tokens", "prompt.1", "seed", "max_output_tokens",
                              "remote_request_id")


def _server_client():
    from starlette.testclient import TestClient

    from kvrelay.server.api import ServerState, build_app
    state = ServerState(engine=_ReadyEngine(), tokenizer=None,  # type: ignore[arg-type]
                        served_names=["m"], max_model_len=96, max_logprobs=5)
    return TestClient(build_app(state), raise_server_exceptions=False)
