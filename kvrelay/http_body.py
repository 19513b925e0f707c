"""A client's JSON body, read bounded and parsed strictly: the checks the API server and
the proxy both make at the door, written once (no torch, no app state).

    chunks ─▶ read_limited: a Content-Length over the limit is refused before any byte
              is read; otherwise bytes are counted as they arrive (chunked bodies too)
              and reading stops at the limit (413; memory never holds more than it)
           ─▶ parse_json: UTF-8, JSON without NaN/Infinity or numbers that overflow to
              infinity, nesting at most MAX_JSON_DEPTH, no lone UTF-16 surrogates (400)

The API server reads from the ASGI `receive` (`asgi_chunks`) and hands the app the same
bytes again (`replay`); the proxy reads Starlette's `request.stream()` and keeps the
parsed object (`parse_object`). Both turn a `BodyError` into an OpenAI error body.

A lone surrogate (`"\\ud800"`) is valid JSON but no valid text: the tokenizer cannot
encode it and the proxy cannot re-encode it for its backends, so it is refused with the
field it sits in. Deep nesting is refused before anything recursive (pydantic, a chat
template, a deep copy, the JSON encoder) sees it. The checks that walk the parsed value
run only when the raw bytes could hold a problem (enough brackets, a `\\uD8..`-`\\uDF..`
escape), so ordinary bodies are parsed once, in C, and nothing else.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

MAX_BODY_BYTES = 32 * 2**20
# Deeper than any OpenAI request (tool schemas nest a few dozen levels at most), far below
# what Python's recursion allows pydantic, a deep copy and the JSON encoder.
MAX_JSON_DEPTH = 128

Receive = Callable[[], Awaitable[dict[str, Any]]]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    """A refused body: `status` (400 or 413), a message naming what is wrong and, where
    one field is at fault, its dotted path (`param`, OpenAI's error field)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ClientGone(Exception):
    """The client disconnected while sending its body."""


def too_large(limit: int = MAX_BODY_BYTES) -> BodyError:
    return BodyError(413, f"request body over {limit} bytes")


# -- reading ---------------------------------------------------------------------------------
async def read_limited(chunks: AsyncIterable[bytes], limit: int = MAX_BODY_BYTES,
                       content_length: str | None = None) -> bytes:
    """The whole body, or BodyError 413 as soon as it is known to exceed `limit` bytes."""
    if content_length and content_length.isdigit() and int(content_length) > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


async def asgi_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The body's chunks from an ASGI `receive`; ClientGone if the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then the client's messages
    (so disconnects still reach streaming responses)."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


def is_json(content_type: str | None) -> bool:
    """FastAPI parses a body as JSON when it has no content type or a JSON one."""
    if not content_type:
        return True
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json"))


# -- parsing ---------------------------------------------------------------------------------
def parse_json(raw: bytes) -> Any:
    """The body's JSON value, or BodyError 400 saying why it is not acceptable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise _too_deep() from None
    if raw.count(b"[") + raw.count(b"{") >= MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        check_tree(value)
    return value


def parse_object(raw: bytes) -> dict[str, Any]:
    """`parse_json`, and the value must be an object (BodyError 400 otherwise)."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise BodyError(400, "the request body must be a JSON object")
    return value


def check_tree(value: Any) -> None:
    """Nesting depth and lone surrogates of a parsed value, iteratively (no recursion on
    deep input); BodyError 400 naming the first problem found."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for key, item in node.items():
                if _LONE_SURROGATE.search(key):
                    raise _surrogate(key, (*path, key))
                stack.append((item, depth + 1, (*path, key)))
        elif isinstance(node, list):             # numbers (token ids) need no visit
            stack.extend((item, depth + 1, (*path, i)) for i, item in enumerate(node)
                         if isinstance(item, (dict, list, str)))
        elif isinstance(node, str) and _LONE_SURROGATE.search(node):
            raise _surrogate(node, path)


def _too_deep() -> BodyError:
    return BodyError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _surrogate(text: str, path: tuple[str | int, ...]) -> BodyError:
    """The path is shown with surrogates escaped: the error body must itself be text."""
    found = _LONE_SURROGATE.search(text)
    code = f"\\u{ord(found.group()):04x}" if found else "\\ud800"
    param = ".".join(_printable(str(p)) for p in path) or None
    return BodyError(400, f"{param or 'the body'}: a lone UTF-16 surrogate ({code}) is not "
                          f"valid text", param)


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _reject_constant(name: str) -> Any:
    raise BodyError(400, f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(400, f"the number {text[:40]} is out of range (numbers must be finite)")
    return value
