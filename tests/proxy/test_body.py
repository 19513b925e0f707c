"""`kvrelay.http_body` as the proxy uses it: the limits and refusals of body reading,
exact values."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay.http_body import MAX_JSON_DEPTH, BodyError, parse_object, read_limited


async def _chunks(parts: list[bytes], seen: list[int]):
    for p in parts:
        seen.append(len(p))
        yield p


def _read(length: str | None, parts: list[bytes],
          limit: int) -> tuple[bytes | BodyError, list[int]]:
    seen: list[int] = []
    try:
        return asyncio.run(read_limited(_chunks(parts, seen), limit, length)), seen
    except BodyError as e:
        return e, seen


def test_read_limited_counts_chunks_as_they_arrive():
    body, seen = _read(None, [b"abc", b"def"], limit=6)
    assert body == b"abcdef" and seen == [3, 3]
    error, seen = _read(None, [b"abc", b"defg", b"never read"], limit=6)
    assert isinstance(error, BodyError) and error.status == 413 and seen == [3, 4]


def test_read_limited_refuses_a_large_content_length_before_reading():
    error, seen = _read(str(7), [b"x" * 7], limit=6)
    assert isinstance(error, BodyError) and error.status == 413 and seen == []


def _nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("depth, ok", [(MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False),
                                       (5000, False),
                                       (100_000, False)])
def test_nesting_limit(depth, ok):
    if ok:
        assert parse_object(_nested(depth))["a"] is not None
        return
    with pytest.raises(BodyError, match=f"nested deeper than {MAX_JSON_DEPTH} levels") as e:
        parse_object(_nested(depth))
    assert e.value.status == 400


@pytest.mark.parametrize("raw, message", [
    (b'{"t": NaN}', "NaN is not valid JSON (numbers must be finite)"),
    (b'{"t": [1, -Infinity]}', "-Infinity is not valid JSON (numbers must be finite)"),
    (b'{"t": 1e400}', "the number 1e400 is out of range (numbers must be finite)"),
    (b'{"t": "a\\ud800b"}', "t: a lone UTF-16 surrogate (\\ud800) is not valid text"),
    (b'{"t": {"\\udc00": 1}}', "t.\\udc00: a lone UTF-16 surrogate (\\udc00) is not valid text"),
    (b'{"t": "\xc3("}', "the request body is not valid UTF-8 (byte 7)"),
    (b'"just a string"', "the request body must be a JSON object"),
])
def test_refusals(raw, message):
    with pytest.raises(BodyError) as e:
        parse_object(raw)
    assert (e.value.status, str(e.value)) == (400, message)


def test_valid_bodies_parse_unchanged():
    assert parse_object(b'{"p": "\\ud83d\\ude00 caf\xc3\xa9", "t": 0.5, "n": [1e308, -2]}') == {
        "p": "\U0001F600 café", "t": 0.5, "n": [1e308, -2]}
