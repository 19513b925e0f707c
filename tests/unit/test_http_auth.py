"""`kvrelay/http_auth.py`: the one API-key check of `kvrelay serve` and `kvrelay proxy`
(issue 26) — exact `Bearer KEY` matching, constant time (digests of equal length, every key
compared), nothing a client sends makes it raise, and both servers use it."""
from __future__ import annotations

import asyncio
import hmac

import pytest

from kvrelay import http_auth
from kvrelay.http_auth import bearer_matches

KEY = "sk-serve-0123456789"


@pytest.mark.parametrize("header", [
    f"Bearer {KEY}",
    f"Bearer {KEY}".encode(),                       # bytes as they came off the wire
])
def test_the_right_key_matches(header):
    assert bearer_matches(header, [KEY])
    assert bearer_matches(header, ["other", KEY, "third"])


@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", KEY, f"bearer {KEY}", f"Bearer  {KEY}", f"Bearer {KEY} ",
    f"Basic {KEY}", f"Bearer {KEY[:-1]}X",           # equal length, last character wrong
    f"Bearer {KEY}"[:-1], f"Bearer {KEY}x",
    "Bearer sk-sérve-\u00ff\u00e9",                  # Latin-1 text (what ASGI decodes bytes to)
    "Bearer \u2603\U0001F600", "Bearer \ud800",       # not Latin-1, a lone surrogate
    b"Bearer \xff\xfe\x00", "Bearer " + "k" * 2**20,  # raw bytes, a megabyte
])
def test_anything_else_does_not_match_and_nothing_raises(header):
    assert not bearer_matches(header, [KEY])


def test_no_keys_and_empty_keys_never_match():
    assert not bearer_matches("Bearer ", [])
    assert not bearer_matches("Bearer ", [""])


def test_non_ascii_keys_match_the_bytes_a_client_sends():
    """A client sends the key's UTF-8 bytes; an ASGI server hands them over decoded as
    Latin-1. (The proxy used to re-encode that text as UTF-8: such a key never matched.)"""
    key = "clé-\u2603"
    wire = f"Bearer {key}".encode()
    assert bearer_matches(wire.decode("latin-1"), [key])
    assert bearer_matches(wire, [key])
    assert not bearer_matches("Bearer cle-\u2603", [key])


def test_every_key_is_compared_as_equal_length_digests(monkeypatch):
    """Constant time: compare_digest sees 32-byte digests whatever the header's and the
    keys' lengths, once per configured key, also after a match."""
    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(http_auth.hmac, "compare_digest", spy)
    keys = ["k1", KEY, "a-much-longer-third-key-" * 4]
    for header in (f"Bearer {KEY}", "Bearer x", "", "Bearer " + "z" * 100_000):
        seen.clear()
        bearer_matches(header, keys)
        assert seen == [(32, 32)] * len(keys)


# -- both servers use it ---------------------------------------------------------------

class _ReadyEngine:
    def __init__(self) -> None:
        self.ready, self.dead, self.info = asyncio.Event(), None, {}
        self.ready.set()


def _spy_on_bearer_matches(monkeypatch) -> list[tuple[object, list[str]]]:
    calls: list[tuple[object, list[str]]] = []
    real = http_auth.bearer_matches

    def spy(header, keys):
        keys = list(keys)
        calls.append((header, keys))
        return real(header, keys)

    monkeypatch.setattr(http_auth, "bearer_matches", spy)
    return calls


def test_serve_checks_its_api_key_with_bearer_matches(monkeypatch):
    from starlette.testclient import TestClient

    from kvrelay.server.api import ServerState, build_app
    calls = _spy_on_bearer_matches(monkeypatch)
    state = ServerState(engine=_ReadyEngine(), tokenizer=None,  # type: ignore[arg-type]
                        served_names=["m"], max_model_len=96, max_logprobs=5, api_key=KEY)
    client = TestClient(build_app(state), raise_server_exceptions=False)
    wrong = f"Bearer {KEY[:-1]}X"                    # same length as the right one
    for headers in ({}, {"Authorization": wrong}, {"Authorization": "Bearer \u00e9".encode()}):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert r.json()["error"]["code"] == 401 and KEY not in r.text
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    assert (wrong, [KEY]) in calls and (f"Bearer {KEY}", [KEY]) in calls
    assert client.get("/health").status_code in (200, 503)         # no key needed


def test_the_proxy_checks_its_api_key_with_bearer_matches(monkeypatch):
    from kvrelay.proxy.state import ProxyAuth
    calls = _spy_on_bearer_matches(monkeypatch)
    auth = ProxyAuth(api_key=KEY)
    assert auth.admits(f"Bearer {KEY}")
    assert not auth.admits(f"Bearer {KEY[:-1]}X") and not auth.admits(None)
    assert not auth.admits("Bearer \u2603")
    assert calls == [(f"Bearer {KEY}", [KEY]), (f"Bearer {KEY[:-1]}X", [KEY]), (None, [KEY]),
                     ("Bearer \u2603", [KEY])]
    assert ProxyAuth().admits(None)                                  # no key: open
