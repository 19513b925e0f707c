"""The door's body checks, without a server: streaming size limit, UTF-8, JSON
constants and ranges, nesting depth, lone surrogates (with the field's path)."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay.server import body_guard
from kvrelay.server.body_guard import MAX_JSON_DEPTH, check_json, read_body
from kvrelay.server.protocol import OpenAIError


def nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "w1 \\ud800"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', "messages.0.content"),
    (b'{"kv_transfer_params": {"\\ud800": 1}}', "kv_transfer_params.\ud800"),
])
def test_lone_surrogates_name_their_path(raw, param):
    error = check_json(raw)
    assert error is not None and error.status == 400 and error.param == param


@pytest.mark.parametrize("raw,words", [
    (b'{"t": NaN}', "NaN"), (b'{"t": -Infinity}', "Infinity"), (b'{"t": 1e400}', "out of range"),
    (b'{"p": "\xc3\x28"}', "UTF-8"), (b'{"p": ', "malformed JSON"), (nested(MAX_JSON_DEPTH + 1), "deeper"),
    (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper"),
])
def test_bad_bodies_are_400(raw, words):
    error = check_json(raw)
    assert error is not None and error.status == 400 and words in error.message


@pytest.mark.parametrize("raw", [
    nested(MAX_JSON_DEPTH), b'{"p": "w1 \\ud83d\\ude00"}', b'{"p": "\\\\ud800"}', b"", b'{"p": [[1, 2]]}',
    b'{"x": 1e300, "y": -0.0}',
])
def test_good_bodies_pass(raw):
    assert check_json(raw) is None


def test_read_body_stops_at_the_limit_as_bytes_arrive():
    """A chunked body is refused once it passes the limit: the rest is never received."""
    chunk, received = b"x" * 1024, []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": chunk, "more_body": True}   # never ends

    with pytest.raises(OpenAIError) as e:
        asyncio.run(read_body(receive, limit=10 * 1024))
    assert e.value.status == 413 and len(received) == 11


def test_replay_gives_the_body_then_the_client():
    async def receive():
        return {"type": "http.disconnect"}

    async def run():
        again = body_guard.replay(b"{}", receive)
        return await again(), await again()
    first, second = asyncio.run(run())
    assert first == {"type": "http.request", "body": b"{}", "more_body": False}
    assert second == {"type": "http.disconnect"}
