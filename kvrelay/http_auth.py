"""The API-key check of `kvrelay serve` and `kvrelay proxy`, written once.

A client presents `Authorization: Bearer KEY`; `bearer_matches` says whether that header
is exactly `Bearer ` + one of the configured keys. The comparison takes the same time
whatever the header holds and whichever key (if any) it matches:

- the header and each `Bearer KEY` are hashed (SHA-256) and the digests compared with
  `hmac.compare_digest`, so neither a key's bytes nor its length shows in the timing
  (compare_digest on the raw values may reveal their lengths); hashing the header takes
  time by its own length, which the client knows anyway;
- every configured key is compared, none skipped after a match.

The header is compared as the bytes the client sent: ASGI servers decode header bytes as
Latin-1, so that is undone (a `str` that is not Latin-1 counts as its UTF-8 bytes), and a
key is its UTF-8 bytes. Nothing the client sends makes this raise: a missing header,
garbage, non-ASCII text, a huge value are just "no". The scheme is matched as vLLM matches
it (and as both servers always did): exactly `Bearer `, one space.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

SCHEME = "Bearer "


def bearer_matches(authorization: str | bytes | None, keys: Iterable[str]) -> bool:
    """True when `authorization` is `Bearer K` for one of `keys` (empty keys never match)."""
    presented = _digest(_header_bytes(authorization))
    matched = False
    for key in keys:
        if not key:
            continue
        expected = _digest(SCHEME.encode() + _key_bytes(key))
        matched |= hmac.compare_digest(presented, expected)
    return matched


def _header_bytes(value: str | bytes | None) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1")           # what an ASGI server decoded the bytes as
    except UnicodeEncodeError:                   # not from a server: its UTF-8 bytes
        return value.encode("utf-8", "surrogatepass")


def _key_bytes(key: str) -> bytes:
    """A key's UTF-8 bytes; one from a command line that was not UTF-8 (Python decodes
    it with surrogateescape) as the bytes it was."""
    try:
        return key.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogatepass")


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
