"""JSON values left as text: how the proxy reads a large body without building it.

A client's body is split once into its top-level fields (`msgspec.Raw`: views into the
body's bytes, nothing copied; msgspec checks the whole text is JSON while splitting). The
proxy forwards those bytes as they came (`body.py`) and reads only what routing needs:
a few small fields, and the head of the prompt (`prefix.py`). A value is either parsed
(a Python value: anything of at most ELEMENT_PARSE_BYTES) or a `RawJSON` — a view of
its text, walked lazily:

- `elements(array)`: its elements in order, each parsed or raw in turn;
- `members(object)`: its members (keys parsed, values as views);
- `string_windows(string)`: its text, decoded a window of the raw bytes at a time.

So reading the first N characters of a 30 MB prompt costs about N characters of memory,
and walking the first messages of a chat costs one message at a time. Parsing everything
would cost ~1x the body for text and ~6x for token ids (a Python int per id).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

ELEMENT_PARSE_BYTES = 16 * 1024        # smaller values are parsed (Python objects: up to ~14x)
STRING_WINDOW_BYTES = 64 * 1024        # a long string is decoded this many raw bytes at a time
_MAX_CUT_BACKOFF = 16                  # an escape is at most 12 bytes (a surrogate pair)

_WHITESPACE = b" \t\r\n"
_QUOTE, _CLOSE_ARRAY = ord('"'), ord("]")
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_SCALAR = re.compile(rb"[^ \t\r\n,\]}]++")
# Inside a container: strings (skipped whole), brackets, and runs of anything else.
_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[\[\]{}]|[^"\[\]{}]++', re.DOTALL)
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


class RawJSON:
    """One JSON value as a view of the body's bytes (already checked to be JSON)."""

    __slots__ = ("buf", "kind")

    def __init__(self, buf: memoryview, kind: str) -> None:
        self.buf = buf
        self.kind = kind                     # '"' string, '[' array, '{' object, 's' scalar

    def __len__(self) -> int:
        return self.buf.nbytes

    def __repr__(self) -> str:
        return f"RawJSON({self.kind!r}, {self.buf.nbytes} bytes)"


def node(buf: Any) -> Any:
    """The JSON value in `buf` (bytes-like): parsed when small, else a `RawJSON`."""
    view = memoryview(buf)
    start = skip_space(view, 0)
    end = view.nbytes
    while end > start and view[end - 1] in _WHITESPACE:
        end -= 1
    view = view[start:end]
    if view.nbytes <= ELEMENT_PARSE_BYTES:
        return json.loads(bytes(view))
    first = view[0:1].tobytes()
    return RawJSON(view, first.decode() if first in (b'"', b"[", b"{") else "s")


def is_string(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, RawJSON) and value.kind == '"')


def is_array(value: Any) -> bool:
    return isinstance(value, list) or (isinstance(value, RawJSON) and value.kind == "[")


def is_object(value: Any) -> bool:
    return isinstance(value, dict) or (isinstance(value, RawJSON) and value.kind == "{")


def parsed(value: Any) -> Any:
    """`value` as a Python value (a raw one parsed whole: only for what must be)."""
    return json.loads(bytes(value.buf)) if isinstance(value, RawJSON) else value


def elements(array: Any) -> Iterator[Any]:
    """The elements of an array (a list, or a raw `[`), in order."""
    if not isinstance(array, RawJSON):
        yield from array
        return
    buf = array.buf
    pos = skip_space(buf, 1)
    if byte_at(buf, pos) == _CLOSE_ARRAY:
        return
    while True:
        end = value_end(buf, pos)
        yield node(buf[pos:end])
        pos = skip_space(buf, end)
        if byte_at(buf, pos) == _CLOSE_ARRAY:
            return
        pos = skip_space(buf, pos + 1)               # past the comma


def members(obj: Any) -> Mapping[str, Any]:
    """The members of an object (a dict, or a raw `{`: each value made a node as it is
    read, so walking a large object holds one value at a time)."""
    if not isinstance(obj, RawJSON):
        return obj
    return _Members(_FIELDS.decode(obj.buf))


class _Members(Mapping[str, Any]):
    def __init__(self, raw: dict[str, msgspec.Raw]) -> None:
        self._raw = raw

    def __getitem__(self, name: str) -> Any:
        return node(self._raw[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def split_fields(body: bytes | bytearray | memoryview) -> dict[str, msgspec.Raw]:
    """A JSON object's top-level members as views of `body` (msgspec.DecodeError /
    ValidationError / RecursionError when it is not one)."""
    return _FIELDS.decode(body)


def string_windows(value: Any) -> Iterator[str]:
    """A string's text in order: the whole of a str, a raw one window by window."""
    if not isinstance(value, RawJSON):
        yield value
        return
    buf = value.buf
    start, stop = 1, buf.nbytes - 1               # inside the quotes
    while start < stop:
        cut = min(stop, start + STRING_WINDOW_BYTES)
        text, cut = _decode_window(buf, start, cut, stop)
        yield text
        start = cut


def _decode_window(buf: memoryview, start: int, cut: int, stop: int) -> tuple[str, int]:
    """The text of raw string bytes [start, cut), the cut moved (by at most a few bytes:
    back, else forward when the window is shorter than one escape) off a UTF-8 sequence
    or an escape it would split; returns the text and the cut used."""
    backward = range(cut, max(start, cut - _MAX_CUT_BACKOFF), -1)
    forward = range(cut + 1, min(stop, cut + _MAX_CUT_BACKOFF) + 1)
    for c in (*backward, *forward):
        if c < stop and 0x80 <= buf[c] < 0xC0:               # inside a UTF-8 sequence
            continue
        try:
            text = msgspec.json.decode(b'"' + bytes(buf[start:c]) + b'"')
        except msgspec.DecodeError:
            continue                                  # an escape split: another cut
        assert isinstance(text, str)
        return text, c
    raise ValueError("no place to split a JSON string")   # not reached for valid JSON


def value_end(buf: memoryview, pos: int) -> int:
    """Where the JSON value starting at `pos` ends."""
    first = byte_at(buf, pos)
    if first == _QUOTE:
        m = _STRING.match(buf, pos)
        assert m is not None
        return m.end()
    if first not in (ord("["), ord("{")):
        m = _SCALAR.match(buf, pos)
        assert m is not None
        return m.end()
    depth = 0
    for m in _TOKEN.finditer(buf, pos):
        c = buf[m.start()]
        if c in b"[{":
            depth += 1
        elif c in b"]}":
            depth -= 1
            if depth == 0:
                return m.end()
    raise ValueError("unterminated JSON value")    # not reached for valid JSON


def byte_at(buf: memoryview, pos: int) -> int:
    """The byte at `pos`, or -1 past the end."""
    return buf[pos] if pos < buf.nbytes else -1


def skip_space(buf: memoryview, pos: int) -> int:
    """The first position from `pos` on that is not JSON whitespace."""
    while pos < buf.nbytes and buf[pos] in _WHITESPACE:
        pos += 1
    return pos
