"""A client's body as the proxy holds it: the bytes it sent, split into top-level fields.

The proxy rewrites a few top-level fields for each leg (the prefill's `max_tokens: 1`,
`stream: false` and `kv_transfer_params`; the decode's `kv_transfer_params`) and reads a
few others to route. So it never builds the whole body: the bytes are split once into
their fields (`rawjson.split_fields`: views, nothing copied), each leg's body is those
bytes with the rewritten fields spliced in (`Payload`, sent a window at a time), and
routing reads parsed values of the small fields and the head of the prompt
(`prefix.Hasher.key` over `rawjson`).

Memory per request is then about the body once, plus bounded pieces: parsing a 7 MB list
of token ids would cost ~6x the body (a Python int per id), re-encoding it for each leg
another 1x each.

Checks: a body of at most INLINE_PARSE_BYTES is parsed whole with `http_body`'s strict
rules (its value is used to route). A larger one is checked with the same rules piece by
piece, never whole: UTF-8 a window at a time, JSON grammar, escapes and surrogates by
msgspec when it is split, then each field of at most FIELD_PARSE_BYTES parsed strictly,
and a larger field walked (`_check_large`): its strings' and its pieces' checks are the
small fields' ones. A refusal names the field (`param`) as the small-body path does.
"""
from __future__ import annotations

import codecs
import json
import re
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvrelay import http_body, rawjson
from kvrelay.http_body import BodyError

INLINE_PARSE_BYTES = 64 * 1024   # larger bodies are checked (and keyed) on a worker thread
FIELD_PARSE_BYTES = 64 * 1024    # a larger field of a large body is checked piece by piece
ARRAY_BATCH_BYTES = 64 * 1024    # a large array's elements are checked this many bytes at once
SEND_WINDOW_BYTES = 64 * 1024  # a leg's body goes to the backend this many bytes at a time
MAX_BODY_NUMBERS = 4 * 2**20 + 262_144   # number literals in a body: serve's cap at most
PROMPT_FIELDS = ("prompt", "messages", "tools", "input", "instructions")
_CUT_TRIES = 8                   # depth-1 commas tried before walking elements one by one


@dataclass
class ClientBody:
    raw: bytes | bytearray
    fields: dict[str, Any]              # name → value: parsed, or `rawjson.RawJSON` when large
    parts: dict[str, msgspec.Raw]       # name → its bytes in `raw`

    @property
    def size(self) -> int:
        return len(self.raw)

    @property
    def prompt_bytes(self) -> int:
        """Bytes of the fields a prompt is made of (a raw key's length estimate)."""
        return sum(len(self.parts[name]) for name in PROMPT_FIELDS if name in self.parts)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def payload(self, changes: Mapping[str, Any], drop: tuple[str, ...] = ()) -> Payload:
        """This body with `changes` set (in place, or appended) and `drop` left out."""
        pieces: list[bytes | memoryview] = []
        for name, raw in self.parts.items():
            if name in drop:
                continue
            value = _encode(changes[name]) if name in changes else memoryview(raw)
            pieces += [b"," if pieces else b"{", _encode(name), b":", value]
        for name, value in changes.items():
            if name not in self.parts and name not in drop:
                pieces += [b"," if pieces else b"{", _encode(name), b":", _encode(value)]
        pieces.append(b"}" if pieces else b"{}")
        return Payload(pieces)


def _encode(value: Any) -> bytes:
    """`value` as httpx's `json=` would send it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode()


class Payload:
    """A leg's JSON body as pieces of the client's bytes and the proxy's own."""

    def __init__(self, pieces: list[bytes | memoryview]) -> None:
        self.pieces = pieces
        self.length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)

    def content(self) -> bytes | AsyncIterator[bytes]:
        """What httpx sends: the bytes when small, else a window at a time (with the
        Content-Length header set, so not chunked)."""
        if self.length <= SEND_WINDOW_BYTES:
            return b"".join(self.pieces)
        return self._windows()

    async def _windows(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            view = memoryview(piece)
            for start in range(0, view.nbytes, SEND_WINDOW_BYTES):
                yield bytes(view[start:start + SEND_WINDOW_BYTES])

    def json(self) -> Any:
        """The body parsed (tests)."""
        return json.loads(b"".join(self.pieces))


# ---------------------------------------------------------------------------- reading

def parse_body(raw: bytes | bytearray) -> ClientBody:
    """The body checked and split (BodyError 400 when refused). A large one takes a
    second or so for tens of MB: call it off the event loop."""
    http_body.check_raw_shape(raw, MAX_BODY_NUMBERS)
    if len(raw) <= INLINE_PARSE_BYTES:
        value = http_body.parse_object(bytes(raw))
        return ClientBody(raw, value, rawjson.split_fields(raw))
    _check_utf8(raw)
    try:
        parts = rawjson.split_fields(raw)
    except msgspec.ValidationError:
        raise BodyError(400, "the request body must be a JSON object") from None
    except msgspec.DecodeError as e:
        raise _malformed(raw, e) from None
    except RecursionError:
        raise http_body.too_deep() from None
    fields: dict[str, Any] = {}
    for name, part in parts.items():
        if len(part) <= FIELD_PARSE_BYTES:
            fields[name] = _strict(bytes(part), name)
        else:
            _check_large(memoryview(part), name, 1)
            fields[name] = rawjson.node(part)
    return ClientBody(raw, fields, parts)


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None) -> bytearray:
    """The body, bounded as `http_body.read_limited` bounds it, grown in one buffer as it
    arrives (no list of chunks to join: that would hold it twice at the end)."""
    limit = http_body.MAX_BODY_BYTES
    if content_length and content_length.isdigit() and int(content_length) > limit:
        raise http_body.too_large(limit)
    buf = bytearray()
    async for chunk in chunks:
        if len(buf) + len(chunk) > limit:
            raise http_body.too_large(limit)
        buf += chunk
    return buf


def _malformed(raw: bytes | bytearray, e: msgspec.DecodeError) -> BodyError:
    """msgspec's refusal in `http_body`'s words where they differ (NaN, Infinity)."""
    at = re.search(r"\(byte (\d+)\)", str(e))
    if at is not None:
        rest = bytes(raw[int(at.group(1)):int(at.group(1)) + 9])
        for name in ("NaN", "Infinity", "-Infinity"):
            if rest.startswith(name.encode()):
                return BodyError(400, f"{name} is not valid JSON (numbers must be finite)")
    return BodyError(400, f"malformed JSON body: {e}")


def _check_utf8(raw: bytes | bytearray) -> None:
    """BodyError 400 unless `raw` is UTF-8 (decoded a window at a time, not whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    step = http_body.SHAPE_WINDOW
    for start in range(0, view.nbytes, step):
        try:
            decoder.decode(view[start:start + step], final=start + step >= view.nbytes)
        except UnicodeDecodeError as e:
            raise BodyError(400, "the request body is not valid UTF-8 "
                            f"(byte {start + e.start})") from None


def _strict(raw: bytes, path: str, index_offset: int = 0) -> Any:
    """`raw` parsed with `http_body`'s rules; a refusal's `param` is placed under `path`
    (and an array index shifted by `index_offset`: the element's place in the whole)."""
    try:
        return http_body.parse_json(raw)
    except BodyError as e:
        raise _within(e, path, index_offset) from None


def _within(e: BodyError, path: str, index_offset: int) -> BodyError:
    root = "the body: "                       # how `http_body` names a value parsed alone
    if e.param is None:
        if not e.message.startswith(root):
            return e                           # not about one place (NaN, malformed JSON)
        return BodyError(e.status, f"{path}: {e.message[len(root):]}", path)
    head, _, rest = e.param.partition(".")
    if index_offset and head.isdigit():
        head = str(int(head) + index_offset)
    param = ".".join(p for p in (path, head, rest) if p)
    message = e.message[len(e.param):] if e.message.startswith(e.param) else f": {e.message}"
    return BodyError(e.status, param + message, param)


def _check_large(buf: memoryview, path: str, depth: int) -> None:
    """The checks of `_strict` on a value too large to parse whole, piece by piece."""
    if depth > http_body.MAX_JSON_DEPTH:
        raise http_body.too_deep()
    first = buf[0:1].tobytes()
    if first == b'"':
        return          # escapes and surrogates: msgspec's split; UTF-8: `_check_utf8`
    if first == b"{":
        for name, part in rawjson.split_fields(buf).items():
            _check_value(memoryview(part), f"{path}.{name}", depth + 1)
        return
    if first != b"[":
        _strict(buf.tobytes(), path)
        return
    index = 0
    for start, end, single in _array_pieces(buf):
        if single:
            _check_value(buf[start:end], f"{path}.{index}", depth + 1)
            index += 1
        else:
            items = _strict(b"[" + buf[start:end].tobytes() + b"]", path, index)
            index += len(items)


def _check_value(buf: memoryview, path: str, depth: int) -> None:
    if buf.nbytes <= FIELD_PARSE_BYTES:
        _strict(buf.tobytes(), path)
    else:
        _check_large(buf, path, depth)


def _array_pieces(buf: memoryview) -> Iterator[tuple[int, int, bool]]:
    """A large array's elements as (start, end, single): runs of whole elements of about
    ARRAY_BATCH_BYTES, or one element larger than that (`single`)."""
    end = buf.nbytes - 1                       # the closing bracket
    pos = rawjson.skip_space(buf, 1)
    while pos < end:
        if end - pos <= ARRAY_BATCH_BYTES:
            yield pos, end, False
            return
        cut = _element_cut(buf, pos, pos + ARRAY_BATCH_BYTES)
        if cut is None:                        # the first element alone is that long
            cut = rawjson.value_end(buf, pos)
            yield pos, cut, True
        else:
            yield pos, cut, False
        pos = rawjson.skip_space(buf, cut)
        if pos < end:                          # past the comma
            pos = rawjson.skip_space(buf, pos + 1)


def _element_cut(buf: memoryview, start: int, target: int) -> int | None:
    """The end of the last element of `buf[start:]` that ends at or before `target` (a
    comma at depth 1, which `[...]` around `buf[start:cut]` parses to prove), or None."""
    window = buf[start:target].tobytes()
    comma = len(window)
    for _ in range(_CUT_TRIES):
        comma = window.rfind(b",", 0, comma)
        if comma <= 0:
            break
        try:
            json.loads(b"[" + window[:comma] + b"]")
            return start + comma
        except ValueError:
            continue                           # inside a string or a nested value
        except RecursionError:
            break
    cut, pos = None, start                     # element by element
    while pos < target:
        stop = rawjson.value_end(buf, pos)
        if stop > target:
            break
        cut = stop
        pos = rawjson.skip_space(buf, stop)
        if rawjson.byte_at(buf, pos) != ord(","):
            break
        pos = rawjson.skip_space(buf, pos + 1)
    return cut
