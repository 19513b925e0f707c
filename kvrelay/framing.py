"""Length-prefixed JSON frames: the framing of kvrelay's KV-plane TCP links (the KV side
channel, the TCP KV transport, the KV-secret handshake). Engine messages — the API ⇄ engine
core pipe and the data-parallel head ⇄ headless node link — use the msgpack codec of
`engine/codec.py` instead.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON encoding an
object. Nothing is unpickled. A reader refuses a frame over its limit without reading the
body (`OversizedFrame`: the stream cannot continue) and one that is not a JSON object
after reading it (`FrameError`: the stream can continue). A frame's buffer grows as its
bytes arrive, so a peer that announces a large frame and sends nothing costs nothing.

Standard library only: the API process and the proxy import this without torch.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

MAX_FRAME = 16 * 1024 * 1024          # the default limit, either direction
_HEADER = struct.Struct(">I")
_CHUNK = 64 * 1024                    # at most this much per receive


class FrameError(ValueError):
    """A frame was oversized or not a JSON object."""


class OversizedFrame(FrameError):
    """A frame's announced length exceeds the limit (its body was not read)."""


def encode_frame(obj: dict[str, Any], max_frame: int = MAX_FRAME, *,
                 allow_nan: bool = False) -> bytes:
    """`obj` as one frame; OversizedFrame when its body exceeds `max_frame`. NaN and
    infinities are refused unless `allow_nan` (Python's JSON extension; both ends of the
    link must be kvrelay)."""
    if not isinstance(obj, dict):
        raise TypeError(f"a frame must hold a dict, got {type(obj).__name__}")
    body = json.dumps(obj, separators=(",", ":"), allow_nan=allow_nan).encode()
    if len(body) > max_frame:
        raise OversizedFrame(f"message of {len(body)} bytes exceeds the {max_frame}-byte "
                             f"frame limit")
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, obj: dict[str, Any], max_frame: int = MAX_FRAME, *,
               allow_nan: bool = False) -> None:
    sock.sendall(encode_frame(obj, max_frame, allow_nan=allow_nan))


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """Exactly n bytes; None on EOF before the first byte; ConnectionError on EOF inside.
    With a `deadline` (time.monotonic()) the whole read must finish by then
    (TimeoutError), however slowly the bytes trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete frame within the time allowed "
                                   f"({len(buf)} of {n} bytes)")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            if not buf:
                return None
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME,
               deadline: float | None = None) -> dict[str, Any] | None:
    """One frame as a dict; None on clean EOF (between frames). OversizedFrame when the
    frame is over `max_frame` (body left unread), FrameError when it is not a JSON
    object (body consumed). `deadline`: see recv_exact."""
    head = recv_exact(sock, _HEADER.size, deadline)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > max_frame:
        raise OversizedFrame(f"frame of {n} bytes exceeds the {max_frame}-byte limit")
    body = recv_exact(sock, n, deadline) if n else b""
    if body is None:
        raise ConnectionError("connection closed inside a frame")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise FrameError(f"frame is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise FrameError(f"frame must hold a JSON object, got {type(obj).__name__}")
    return obj
