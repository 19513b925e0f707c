"""The proxy never spreads a crash (issue 26): a backend that took a request and closed the
connection without answering — it may have crashed on that very request — gets the request
once; the client gets a 502 and no other server sees it. Only a server the proxy could not
connect to is replaced by the next one. A keep-alive connection an idle backend closed is
honest and is replaced without a failure."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvrelay.proxy.answers import is_connect_error
from kvrelay.proxy.state import KEEPALIVE_EXPIRY_S
from tests.proxy.conftest import IDLE_CLOSE_S
from tests.proxy.fakes import client, refused_port, wait_for
from tests.proxy.test_hardening import assert_openai_error
from tests.proxy.test_relay import _samples

BODY = {"prompt": "x", "max_tokens": 3}


def failures(proxy, role: str, reason: str) -> float:
    """kvrelay_proxy:backend_failures_total of `role` for `reason`, all backends together."""
    return sum(value for (name, labels), value in _samples(proxy).items()
               if name == "kvrelay_proxy:backend_failures_total"
               and dict(labels).get("role") == role and dict(labels).get("reason") == reason)


@pytest.mark.parametrize("topology, servers", [("crashing_prefills", (0, 1)),
                                               ("resetting_prefills", (2, 3))],
                         ids=["fin", "rst"])
def test_a_prefill_that_closes_without_answering_is_502_and_sent_nowhere_else(
        fakes, proxies, topology, servers):
    """Two prefills that read the whole request and close (FIN, or RST): each request
    reaches exactly one of them, and the client gets the proxy's 502."""
    proxy = proxies[topology]
    crashers = [fakes.no_answer[i] for i in servers]
    before = failures(proxy, "prefill", "transport")
    with client() as c:
        for i in range(3):
            request_id = f"{topology}-{i}"
            r = c.post(f"{proxy.url}/v1/completions", json=BODY,
                       headers={"X-Request-Id": request_id})
            error = assert_openai_error(r, 502, "BadGatewayError")
            assert "closed the connection without answering" in error["message"]
            assert "not sent to another server" in error["message"]
            assert r.headers["x-request-id"] == request_id
            assert [s.received.count(request_id) for s in crashers] in ([1, 0], [0, 1])
    assert fakes.decode.completions() == []
    assert failures(proxy, "prefill", "transport") == before + 3      # marked failed each time
    log = proxy.log()
    assert "took the request and closed the connection without answering" in log


def test_a_decode_that_closes_without_answering_is_502_and_the_prefill_frees(fakes, proxies):
    proxy = proxies["crashing_decodes"]
    crashers = fakes.no_answer[:2]
    prefill = fakes.prefill[0]
    with client() as c:
        r = c.post(f"{proxy.url}/v1/completions", json=BODY | {"stream": True},
                   headers={"X-Request-Id": "dec-crash"})
    error = assert_openai_error(r, 502, "BadGatewayError")
    assert error["message"].startswith("decode server 127.0.0.1:")
    assert [s.received.count("dec-crash") for s in crashers] in ([1, 0], [0, 1])
    assert len(prefill.completions()) == 1                     # prefilled once, not again
    wait_for(lambda: prefill.frees(), what="the free notice")
    assert prefill.frees()[0].body["remote_request_id"] == "prefill-dec-crash"
    assert failures(proxy, "decode", "transport") >= 1


def test_a_refused_connection_goes_to_the_next_server_on_both_legs(fakes, proxies):
    """`refused_first` ([refused, B] → [refused, D]) is used by this test alone, so its
    first request meets the refusing servers first on both legs."""
    proxy = proxies["refused_first"]
    b = fakes.prefill[1]
    with client() as c:
        r = c.post(f"{proxy.url}/v1/completions", json=BODY, headers={"X-Request-Id": "refused"})
    assert r.status_code == 200, r.text
    assert [x.headers["x-request-id"] for x in b.completions()] == ["refused"]
    assert [x.headers["x-request-id"] for x in fakes.decode.completions()] == ["refused"]
    assert failures(proxy, "prefill", "connect") == 1
    assert failures(proxy, "decode", "connect") == 1
    assert failures(proxy, "prefill", "transport") == failures(proxy, "decode", "transport") == 0


def test_keep_alive_connections_closed_by_an_idle_backend_are_replaced_not_failed(fakes,
                                                                                 proxies):
    """The backends close a connection idle for IDLE_CLOSE_S; the proxy keeps idle ones for
    KEEPALIVE_EXPIRY_S, longer. After each pause the proxy's pooled connection is one the
    backend closed: httpx finds it closed before writing and opens a new one — no failure,
    no 502 (the honest stale-connection case, as before issue 26)."""
    pause = IDLE_CLOSE_S + 0.5
    assert pause < KEEPALIVE_EXPIRY_S          # the proxy still holds the closed connection
    proxy = proxies["idle_closing"]
    prefill, decode = fakes.idle
    with client() as c:
        for i in range(6):
            if i in (1, 2):
                time.sleep(pause)
            r = c.post(f"{proxy.url}/v1/completions", json=BODY,
                       headers={"X-Request-Id": f"idle-{i}"})
            assert r.status_code == 200, r.text
    for fake in (prefill, decode):
        ports = [x.client_port for x in fake.completions()]
        assert len(ports) == 6
        assert len(set(ports[:3])) == 3       # after each pause: a new connection
        assert len(set(ports[2:])) < 4        # back to back: a connection was reused
    for role in ("prefill", "decode"):
        assert failures(proxy, role, "transport") == failures(proxy, role, "connect") == 0


# ------------------------------------------------------------------ what httpx does

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def _read_one(reader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)


def test_the_httpx_behaviour_the_rule_rests_on():
    """Pinned, in-process: (1) a pooled connection the server closed while idle is found
    closed and replaced before the request is written — no error; (2) a server that read
    the request and closed raises RemoteProtocolError, no ConnectError, so `is_connect_error`
    keeps it from being re-sent; (3) a closed port is a ConnectError."""

    async def idle_closer(reader, writer):        # answers, closes after 0.05 s idle
        try:
            while True:
                await asyncio.wait_for(_read_one(reader), 0.05)
                writer.write(_OK)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def crasher(reader, writer):             # reads the request, closes, no answer
        await _read_one(reader)
        writer.close()

    connects: list[str] = []

    async def trace(event: str, _info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            connects.append(event)

    async def run(refused_port: int) -> tuple[BaseException, BaseException]:
        idle = await asyncio.start_server(idle_closer, "127.0.0.1", 0)
        crash = await asyncio.start_server(crasher, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(trust_env=False) as c:
                for _ in range(3):
                    r = await c.post(_url(idle), json={}, extensions={"trace": trace})
                    assert r.status_code == 200
                    await asyncio.sleep(0.2)        # the server closes the pooled connection
                crashed = await _error_of(c.post(_url(crash), json={}))
                refused = await _error_of(c.post(f"http://127.0.0.1:{refused_port}/", json={}))
            return crashed, refused
        finally:
            idle.close()
            crash.close()

    sock, port = refused_port()
    try:
        crashed, refused = asyncio.run(run(port))
    finally:
        sock.close()
    assert len(connects) == 3                      # a new connection each time, no error
    assert isinstance(crashed, httpx.RemoteProtocolError) and not is_connect_error(crashed)
    assert isinstance(refused, httpx.ConnectError) and is_connect_error(refused)


def _url(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"


async def _error_of(call) -> BaseException:
    try:
        await call
    except httpx.TransportError as e:
        return e
    raise AssertionError("no error")
