"""Request bodies, read and checked at the door (before FastAPI parses them).

    receive ─▶ read_body: counts bytes as they arrive, Content-Length or chunked,
               and stops at the limit (413; memory never holds more than the limit)
            ─▶ check_json: UTF-8, JSON without NaN/Infinity or numbers out of float
               range, nesting at most MAX_JSON_DEPTH, no lone UTF-16 surrogates (400)
            ─▶ the app receives the same bytes again (`replay`)

A lone surrogate (`"\\ud800"`) is valid JSON but no valid text: the tokenizer cannot
encode it, so it is refused here with the field it sits in. Deep nesting is refused
before anything recursive (pydantic, the tokenizer's chat template) sees it. The
checks that walk the parsed value run only when the raw bytes could hold a problem
(enough brackets, a `\\uD8..`-`\\uDF..` escape), so ordinary bodies are parsed once
more in C and nothing else.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from kvrelay.server.protocol import OpenAIError

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_JSON_DEPTH = 128

Receive = Callable[[], Awaitable[dict[str, Any]]]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    """The client disconnected while sending its body."""


def too_large(limit: int = MAX_BODY_BYTES) -> OpenAIError:
    return OpenAIError(f"request body over {limit} bytes", 413, "RequestTooLarge")


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, or `OpenAIError` 413 as soon as more than `limit` bytes came."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise too_large(limit)
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


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
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def check_json(raw: bytes) -> OpenAIError | None:
    """Why `raw` is not an acceptable JSON body (a 400), or None."""
    if not raw.strip():
        return None                          # FastAPI reports the missing body itself
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return OpenAIError(f"the request body is not valid UTF-8 (byte {e.start})")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        return OpenAIError(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    except ValueError as e:                  # JSONDecodeError, NaN/Infinity, huge numbers
        return OpenAIError(f"malformed JSON body: {e}")
    if raw.count(b"[") + raw.count(b"{") >= MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        return _walk(value)
    return None


def _walk(value: Any) -> OpenAIError | None:
    """Nesting depth and lone surrogates, iteratively (no recursion on deep input)."""
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, (dict, list)) and depth > MAX_JSON_DEPTH:
            return OpenAIError(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(v, dict):
            for key, item in v.items():
                if _LONE_SURROGATE.search(key):
                    return _surrogate(path + (key,))
                stack.append((item, depth + 1, path + (key,)))
        elif isinstance(v, list):                # numbers (token ids) need no visit
            stack.extend((item, depth + 1, path + (i,)) for i, item in enumerate(v)
                         if isinstance(item, (dict, list, str)))
        elif isinstance(v, str) and _LONE_SURROGATE.search(v):
            return _surrogate(path)
    return None


def _surrogate(path: tuple) -> OpenAIError:
    param = ".".join(str(p) for p in path) or None
    return OpenAIError(f"{param or 'the body'}: a lone UTF-16 surrogate (e.g. \\ud800) is not "
                       f"valid text", param=param)
