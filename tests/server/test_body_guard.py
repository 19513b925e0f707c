"""The API server's door (`kvrelay/http_body.py` over ASGI), without a server: streaming
size limit, UTF-8, JSON constants and ranges, nesting depth, lone surrogates (with the
field's path)."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay import http_body
from kvrelay.http_body import MAX_JSON_DEPTH, BodyError, asgi_chunks, read_limited


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
