"""Reading a client's JSON body: bounded as it streams, strict as it parses.

Pure functions (no app state), so each refusal is unit-tested with exact values:

- `read_limited`: the body's bytes, counting chunked bodies as they arrive (a Content-Length
  over the limit is refused before any byte is read) — `BodyError` 413 past the limit.
- `parse_object`: strict JSON — a `BodyError` 400 for invalid UTF-8, malformed JSON, NaN /
  Infinity / numbers that overflow to infinity, lone UTF-16 surrogates (`"\\ud800"`, which
  cannot be re-encoded for the backends) and nesting deeper than `MAX_JSON_DEPTH` (which
  would exhaust the recursion of the copy and the re-encoding further on).
"""
from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

MAX_BODY_BYTES = 32 * 2**20
# Deeper than any OpenAI request (tool schemas nest a few dozen levels at most), far below
# what Python's recursion allows the deep copy and the JSON encoder.
MAX_JSON_DEPTH = 128


class BodyError(ValueError):
    """A body the proxy refuses: `status` (400 or 413) and a message naming what is wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_limited(content_length: str | None, chunks: AsyncIterator[bytes],
                       limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, or BodyError 413 as soon as it is known to exceed `limit` bytes."""
    if content_length and content_length.isdigit() and int(content_length) > limit:
        raise BodyError(413, f"request body over {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or BodyError 400 saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise BodyError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BodyError(400, "the request body must be a JSON object")
    check_tree(body)
    return body


def check_tree(value: Any) -> None:
    """Depth and string checks over a parsed JSON value, iteratively (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_JSON_DEPTH:
                raise BodyError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            for key, item in node.items():
                _check_string(key)
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_JSON_DEPTH:
                raise BodyError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            _check_string(node)


def _check_string(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BodyError(400, f"the JSON body has a lone UTF-16 surrogate "
                                 f"(\\u{ord(s[e.start]):04x}): not a Unicode string") from None


def _reject_constant(name: str) -> Any:
    raise BodyError(400, f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(400, f"the number {text[:40]} is out of range (numbers must be finite)")
    return value
