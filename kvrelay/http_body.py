"""A client's JSON body, read bounded and parsed strictly: the checks the API server and
the proxy both make at the door, written once (no torch, no app state).

    chunks ─▶ read_limited: a Content-Length over the limit is refused before any byte
              is read; otherwise bytes are counted as they arrive (chunked bodies too)
              and reading stops at the limit (413; memory never holds more than it)
           ─▶ parse_json: UTF-8, JSON without NaN/Infinity or numbers that overflow to
              infinity, integers of at most MAX_INT_DIGITS digits, nesting at most
              MAX_JSON_DEPTH, no lone UTF-16 surrogates (400)

The API server reads from the ASGI `receive` (`asgi_chunks`) and hands the app the same
bytes again (`replay`); the proxy reads Starlette's `request.stream()` and keeps the
parsed object (`parse_object`). Both turn a `BodyError` into an OpenAI error body.

A lone surrogate (`"\\ud800"`) is valid JSON but no valid text: the tokenizer cannot
encode it and the proxy cannot re-encode it for its backends, so it is refused with the
field it sits in. Deep nesting is refused before anything recursive (pydantic, a chat
template, a deep copy, the JSON encoder) sees it. An integer literal longer than
MAX_INT_DIGITS digits fits no field, and past 4,300 digits Python's own conversion raises
(a 500 before this check): it is refused, with its path, before `int()` ever sees it. The
checks that walk the parsed value run only when the raw bytes could hold a problem
(enough brackets, a `\\uD8..`-`\\uDF..` escape, a run of more than MAX_INT_DIGITS
digits), so ordinary bodies are parsed once, in C, and nothing else.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 32 * 2**20
# Deeper than any OpenAI request (tool schemas nest a few dozen levels at most), far below
# what Python's recursion allows pydantic, a deep copy and the JSON encoder.
MAX_JSON_DEPTH = 128
# Longer than any integer a request field takes (int64 seeds: 19 digits; a 256-bit schema
# bound: 78), short enough that every accepted integer converts to a finite float and
# parses in microseconds (Python refuses over 4,300 digits, as a ValueError).
MAX_INT_DIGITS = 100
# A body's shape, counted on its raw bytes before the parse (check_raw_shape): more arrays
# and objects, or strings, than any request needs (tool schemas, messages and batches need
# far fewer; a whole vocabulary of logit_bias keys fits) would cost the parse ~1 KB of
# Python objects each — 14x the body for 200,000 tools.
MAX_JSON_CONTAINERS = 65_536
MAX_JSON_STRINGS = 262_144

Receive = Callable[[], Awaitable[dict[str, Any]]]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Every digit becomes "0", every other byte a space: a run of more than MAX_INT_DIGITS
# digits anywhere in the body is then one substring search (C speed; a regex took 6x
# longer on a 28 MiB list of token ids).
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_DIGIT_RUN = b"0" * (MAX_INT_DIGITS + 1)


def check_raw_shape(raw: bytes | bytearray, max_numbers: int) -> None:
    """BodyError 400 when the raw JSON body holds more containers, strings or number
    literals than any request may (`param` "prompt" for the numbers: token ids are what a
    body holds many of). Counts inside strings are separated out only when a plain count
    is over its cap (a long text full of brackets or digits is fine). Numbers are counted
    on translated windows of SHAPE_WINDOW bytes, never a translated copy of the whole."""
    quotes = raw.count(b'"')
    if quotes > 2 * MAX_JSON_STRINGS:
        quotes = _unescaped(raw).count(b'"')          # \" inside strings is no delimiter
        if quotes > 2 * MAX_JSON_STRINGS:
            raise BodyError(400, f"the body holds more than {MAX_JSON_STRINGS} JSON strings")
    containers = raw.count(b"[") + raw.count(b"{")
    if containers <= MAX_JSON_CONTAINERS and _numbers(raw, 0, len(raw)) <= max_numbers:
        return
    containers, numbers = _outside_strings(_unescaped(raw))
    if containers > MAX_JSON_CONTAINERS:
        raise BodyError(400, f"the body holds more than {MAX_JSON_CONTAINERS} JSON arrays and "
                        "objects")
    if numbers > max_numbers:
        raise BodyError(400, f"the body holds more than {max_numbers} numbers", "prompt")


SHAPE_WINDOW = 64 * 1024


def _numbers(raw: bytes | bytearray, start: int, end: int) -> int:
    """Number literals (runs of digits) in raw[start:end], a window at a time."""
    count, after_digit = 0, False
    for s in range(start, end, SHAPE_WINDOW):
        digits = raw[s:min(end, s + SHAPE_WINDOW)].translate(_DIGITS_AS_ZEROS)
        count += digits.count(b" 0") + (digits[:1] == b"0" and not after_digit)
        after_digit = digits[-1:] == b"0"
    return count


def _unescaped(raw: bytes | bytearray) -> bytes | bytearray:
    """`raw` without its escaped backslashes and quotes: every `"` left delimits a string.
    (Escapes pair up left to right, as `replace` finds them; no copy when there are none.)"""
    if b"\\" not in raw:
        return raw
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_strings(clean: bytes | bytearray) -> tuple[int, int]:
    """Containers and number literals outside strings (`clean` has no escaped quotes)."""
    containers = numbers = 0
    start = 0
    while True:
        quote = clean.find(b'"', start)
        end = len(clean) if quote < 0 else quote
        containers += clean.count(b"[", start, end) + clean.count(b"{", start, end)
        numbers += _numbers(clean, start, end)
        if quote < 0:
            return containers, numbers
        close = clean.find(b'"', quote + 1)
        if close < 0:                           # malformed: the parse will say where
            return containers, numbers
        start = close + 1


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
@dataclass(frozen=True)
class DecodedBody:
    """A body's text and what its raw bytes said about it (`decode`): the caller may drop
    the bytes before `parse_text`, so the parse holds the text and the value, not three
    copies of the body."""
    text: str
    long_digits: bool               # a run of more than MAX_INT_DIGITS digits
    walk: bool                      # the parsed value needs `check_tree`


def parse_json(raw: bytes) -> Any:
    """The body's JSON value, or BodyError 400 saying why it is not acceptable."""
    return parse_text(decode(raw))


def decode(raw: bytes) -> DecodedBody:
    """The body as UTF-8 text with the raw-byte hints `parse_text` needs; BodyError 400
    when it is not UTF-8."""
    long_digits = _has_long_digit_run(raw)       # the hints first: the text is not yet held
    walk = (long_digits or raw.count(b"[") + raw.count(b"{") >= MAX_JSON_DEPTH
            or _SURROGATE_ESCAPE.search(raw) is not None)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    return DecodedBody(text, long_digits, walk)


def _has_long_digit_run(raw: bytes) -> bool:
    """A run of more than MAX_INT_DIGITS digits anywhere: searched SHAPE_WINDOW bytes at a
    time (each window overlapping the next by the run's length), so it costs a window of
    memory, not a translated copy of the whole body."""
    step, overlap = SHAPE_WINDOW, len(_LONG_DIGIT_RUN)
    return any(_LONG_DIGIT_RUN in raw[start:start + step + overlap].translate(_DIGITS_AS_ZEROS)
               for start in range(0, max(len(raw), 1), step))


def parse_text(body: DecodedBody) -> Any:
    """`decode`'s text parsed strictly; BodyError 400 saying why it is not acceptable."""
    text, long_digits = body.text, body.long_digits
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                           parse_int=_bounded_int if long_digits else None)
    except BodyError:
        raise
    except json.JSONDecodeError as e:
        raise BodyError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise too_deep() from None
    except ValueError as e:                  # a number Python will not convert; not expected
        raise BodyError(400, f"unacceptable number in the JSON body: {e}") from None
    if body.walk:
        check_tree(value)
    return value


def parse_object(raw: bytes | DecodedBody) -> dict[str, Any]:
    """`parse_json` (of `decode`'s result, if given one), and the value must be an object
    (BodyError 400 otherwise)."""
    value = parse_text(raw if isinstance(raw, DecodedBody) else decode(raw))
    if not isinstance(value, dict):
        raise BodyError(400, "the request body must be a JSON object")
    return value


def check_tree(value: Any) -> None:
    """Nesting depth, lone surrogates and over-long integers of a parsed value, iteratively
    (no recursion on deep input); BodyError 400 naming the first problem found."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise too_deep()
        if isinstance(node, dict):
            for key, item in node.items():
                if _LONE_SURROGATE.search(key):
                    raise _surrogate(key, (*path, key))
                stack.append((item, depth + 1, (*path, key)))
        elif isinstance(node, list):             # numbers (token ids) need no visit
            stack.extend((item, depth + 1, (*path, i)) for i, item in enumerate(node)
                         if isinstance(item, (dict, list, str, _LongInt)))
        elif isinstance(node, str) and _LONE_SURROGATE.search(node):
            raise _surrogate(node, path)
        elif isinstance(node, _LongInt):
            raise _long_int(node, path)


class _LongInt:
    """Stands in for an integer literal of more than MAX_INT_DIGITS digits while parsing
    (never converted: `int()` raises over 4,300 digits), so that `check_tree` can name
    where it sits."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _bounded_int(text: str) -> int | _LongInt:
    digits = len(text.lstrip("-"))
    return _LongInt(digits) if digits > MAX_INT_DIGITS else int(text)


def _long_int(node: _LongInt, path: tuple[str | int, ...]) -> BodyError:
    param = _param(path)
    return BodyError(400, f"{param or 'the body'}: an integer of {node.digits} digits is out "
                          f"of range (at most {MAX_INT_DIGITS} digits)", param)


def _param(path: tuple[str | int, ...]) -> str | None:
    """A JSON path as OpenAI's `param`, dotted, with surrogates escaped."""
    return ".".join(_printable(str(p)) for p in path) or None


def too_deep() -> BodyError:
    return BodyError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _surrogate(text: str, path: tuple[str | int, ...]) -> BodyError:
    """The path is shown with surrogates escaped: the error body must itself be text."""
    found = _LONE_SURROGATE.search(text)
    code = f"\\u{ord(found.group()):04x}" if found else "\\ud800"
    param = _param(path)
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
