"""The side channel: round trips, refusals that leave the server serving, clear errors."""
from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from kvrelay.disagg.side_channel import (
    ADVERTISE_HOST_ENV,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    advertised_host,
    recv_frame,
    side_channel_call,
)
from tests.processes import free_port


def handler(msg: dict) -> dict:
    if msg.get("op") == "echo":
        return {"echo": msg.get("payload")}
    if msg.get("op") == "refuse":
        raise SideChannelError("compat hash mismatch: dtype: 'bfloat16' vs 'float32'")
    if msg.get("op") == "boom":
        raise KeyError("x")
    if msg.get("op") == "not-a-dict":
        return [1, 2]  # type: ignore[return-value]
    return {"seen": sorted(msg)}


@pytest.fixture
def server():
    srv = SideChannelServer("127.0.0.1", 0, handler, max_frame=4096).start()
    try:
        yield srv
    finally:
        srv.close()


def raw(server) -> socket.socket:
    s = socket.create_connection(server.address, timeout=5)
    return s


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_round_trip_and_many_requests_per_connection(server):
    host, port = server.address
    assert side_channel_call(host, port, {"op": "echo", "payload": {"a": [1, 2.5, "x", None]}}) \
        == {"echo": {"a": [1, 2.5, "x", None]}}
    with SideChannelClient(host, port) as c:
        for i in range(20):
            assert c.call({"op": "echo", "payload": i}) == {"echo": i}


def test_handler_errors_are_replies_not_crashes(server):
    host, port = server.address
    with pytest.raises(SideChannelError, match="compat hash mismatch: dtype"):
        side_channel_call(host, port, {"op": "refuse"})
    with pytest.raises(SideChannelError, match="KeyError"):
        side_channel_call(host, port, {"op": "boom"})
    with pytest.raises(SideChannelError, match="not a dict"):
        side_channel_call(host, port, {"op": "not-a-dict"})
    assert side_channel_call(host, port, {"op": "echo", "payload": 1}) == {"echo": 1}


def test_oversized_frame_rejected_and_server_still_serves(server):
    with raw(server) as s:
        s.sendall(frame(b"{" + b" " * 5000 + b"}"))             # over this server's 4096
        reply = recv_frame(s)
        assert reply["ok"] is False and "exceeds" in reply["error"]
        try:                                                     # then the connection closes
            assert s.recv(1) == b""
        except ConnectionResetError:                             # (unread bytes: a reset)
            pass
    with raw(server) as s:                                       # announced 4 GiB, never sent
        s.sendall(struct.pack(">I", 0xFFFFFFFF))
        assert recv_frame(s)["ok"] is False
    # a client-side oversized message never leaves
    big = {"op": "echo", "payload": "x" * 5000}
    with (pytest.raises(SideChannelError, match="exceeds"),
          SideChannelClient(*server.address, max_frame=4096) as c):
        c.call(big)
    assert side_channel_call(*server.address, {"op": "echo", "payload": 2}) == {"echo": 2}


def test_default_request_limit_is_64_kib():
    with SideChannelServer("127.0.0.1", 0, handler) as srv, raw(srv) as s:
        s.sendall(struct.pack(">I", 64 * 1024 + 1))
        assert "exceeds" in recv_frame(s)["error"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"[" * 3000])
def test_malformed_frames_rejected_connection_survives(server, body):
    with raw(server) as s:
        s.sendall(frame(body))
        reply = recv_frame(s)
        assert reply["ok"] is False and reply["error"]
        s.sendall(frame(json.dumps({"op": "echo", "payload": "after"}).encode()))
        assert recv_frame(s) == {"ok": True, "result": {"echo": "after"}}


def test_truncated_frame_and_abrupt_close_do_not_harm_the_server(server):
    with raw(server) as s:
        s.sendall(struct.pack(">I", 100) + b'{"op"')
    with raw(server) as s:
        s.sendall(b"\x00\x00")
    assert side_channel_call(*server.address, {"op": "echo", "payload": 3}) == {"echo": 3}


def test_concurrent_clients(server):
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with SideChannelClient(*server.address) as c:
                for j in range(10):
                    assert c.call({"op": "echo", "payload": [i, j]}) == {"echo": [i, j]}
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors


def test_connection_refused_names_address_and_env():
    port = free_port()
    with pytest.raises(SideChannelError) as e:
        side_channel_call("127.0.0.1", port, {"op": "echo"}, timeout=2)
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "refused" in msg
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in msg and "VLLM_NIXL_SIDE_CHANNEL_PORT" in msg


def test_listen_error_names_address():
    with (SideChannelServer("127.0.0.1", 0, handler) as srv,
          pytest.raises(SideChannelError, match=f"127.0.0.1:{srv.address[1]}.*VLLM_NIXL")):
        SideChannelServer("127.0.0.1", srv.address[1], handler).start()


def test_advertised_host(monkeypatch):
    monkeypatch.delenv(ADVERTISE_HOST_ENV, raising=False)
    host = advertised_host("0.0.0.0")
    assert host not in ("0.0.0.0", "", "::")
    socket.inet_aton(host)                                       # an IPv4 address
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "prefill-0.example")
    assert advertised_host("0.0.0.0") == "prefill-0.example"


def test_wildcard_server_reachable_at_advertised_address(monkeypatch):
    monkeypatch.delenv(ADVERTISE_HOST_ENV, raising=False)
    with SideChannelServer("0.0.0.0", 0, handler) as srv:
        host, port = srv.advertised_address
        assert host != "0.0.0.0"
        assert side_channel_call(host, port, {"op": "echo", "payload": "hi"}) == {"echo": "hi"}


def test_interface_addresses_skip_loopback():
    from kvrelay.disagg.side_channel import interface_addresses
    for name, ip in interface_addresses():
        socket.inet_aton(ip)
        assert not ip.startswith("127.") and name != "lo"
