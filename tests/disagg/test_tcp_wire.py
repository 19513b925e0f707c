"""The TCP transport's server against hostile or broken clients, and cancellation."""
from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time

import pytest
import torch

from kvrelay.disagg.side_channel import recv_frame, send_frame
from kvrelay.disagg.tcp import TcpTransport
from kvrelay.disagg.transport import ReadDesc, TransferError


@pytest.fixture
def two():
    a, b = TcpTransport(), TcpTransport()
    try:
        a.register([torch.arange(256, dtype=torch.float32), torch.ones(16, dtype=torch.bfloat16)])
        b.register([torch.zeros(256, dtype=torch.float32), torch.zeros(16, dtype=torch.bfloat16)])
        b.add_peer("a", a.metadata())
        yield a, b
    finally:
        b.close()
        a.close()


def wait_notifications(t, n, timeout=10.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += t.take_notifications()
        time.sleep(0.002)
    return got


def request(sock, msg):
    send_frame(sock, msg)
    return recv_frame(sock)


def test_server_refuses_bad_requests_and_keeps_serving(two):
    a, b = two
    size = 256 * 4
    a.max_descs = 10
    with socket.create_connection(a.address, timeout=5) as s:
        for descs, why in [([[0, size - 4, 8]], "outside region 0"),
                           ([[5, 0, 4]], "region 5 does not exist"),
                           ([[0, -4, 4]], "outside"),
                           ([[0, 0, 0]], "outside"),
                           ([[0, 0, True]], "integers"),
                           ([[0, 0]], "integers"),
                           ("nope", "list"),
                           ([[0, 0, 4]] * 11, "exceed")]:
            reply = request(s, {"op": "read", "descs": descs})
            assert reply["ok"] is False and why in reply["error"], (descs[:1], reply)
        assert request(s, {"op": "drop-tables"})["ok"] is False
        assert request(s, {"op": "notify", "notify": "%%%"})["ok"] is False
        assert request(s, {"op": "notify", "notify": base64.b64encode(b"x" * 70000).decode()})[
            "ok"] is False
        s.sendall(struct.pack(">I", 3) + b"{{{")
        assert recv_frame(s)["ok"] is False
        # the same connection still reads fine
        assert request(s, {"op": "read", "descs": [[0, 8, 8]]})["error"] == "notify must be base64"
        reply = request(s, {"op": "read", "descs": [[0, 8, 8]], "notify": "cmF3"})
        assert reply == {"ok": True, "nbytes": 8}
        data = b""
        while len(data) < 8:
            data += s.recv(8 - len(data))
        assert data == torch.tensor([2.0, 3.0]).numpy().tobytes()
        send_frame(s, {"op": "ack"})
        assert wait_notifications(a, 1) == [b"raw"]
    with socket.create_connection(a.address, timeout=5) as s:
        s.sendall(struct.pack(">I", 0xFFFFFFFF))                # oversized: refused, closed
        assert recv_frame(s)["ok"] is False
    with socket.create_connection(a.address, timeout=5) as s:
        s.sendall(struct.pack(">I", 50) + b"{")               # truncated, then gone
    assert a.take_notifications() == []
    h = b.start_read("a", [ReadDesc(0, 0, 0, 16), ReadDesc(1, 4, 4, 8)], b"ok")
    b.wait(h)
    b.release(h)
    assert wait_notifications(a, 1) == [b"ok"]
    assert b._flat[0][:16].view(torch.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert b._flat[1].view(torch.bfloat16).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0] + [0.0] * 10


def test_consumer_refuses_a_short_or_lying_server():
    """A 'peer' that announces the wrong byte count or drops the connection mid-data."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    modes = iter(["wrong-count", "short"])

    def serve():
        for mode in modes:
            conn, _ = srv.accept()
            with conn:
                recv_frame(conn)
                if mode == "wrong-count":
                    send_frame(conn, {"ok": True, "nbytes": 999})
                else:
                    send_frame(conn, {"ok": True, "nbytes": 64})
                    conn.sendall(b"\x01" * 10)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    b = TcpTransport(timeout=5)
    try:
        b.register([torch.zeros(64, dtype=torch.uint8)])
        b.add_peer("liar", {"transport": "tcp", "version": 1, "host": "127.0.0.1", "port": port,
                            "regions": [64]})
        for match in ["announced 999 bytes", "closed the connection"]:
            h = b.start_read("liar", [ReadDesc(0, 0, 0, 64)], b"n")
            with pytest.raises(TransferError, match=match):
                b.wait(h, timeout=10)
            b.release(h)
    finally:
        b.close()
        srv.close()
        t.join(5)


def test_release_cancels_a_stuck_read():
    """A peer that accepts and never answers: release() returns promptly and the read fails."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    b = TcpTransport(timeout=30)
    try:
        b.register([torch.zeros(64, dtype=torch.uint8)])
        b.add_peer("mute", {"transport": "tcp", "version": 1, "host": "127.0.0.1",
                            "port": srv.getsockname()[1], "regions": [64]})
        h = b.start_read("mute", [ReadDesc(0, 0, 0, 64)], b"n")
        assert b.poll(h) == "pending"
        conn, _ = srv.accept()
        b.release(h)
        assert h.future.done()
        with pytest.raises(TransferError, match="released"):
            b.poll(h)
        conn.close()
    finally:
        b.close()
        srv.close()


def test_read_of_a_dead_peer_fails_cleanly(two):
    a, b = two
    a.close()
    h = b.start_read("a", [ReadDesc(0, 0, 0, 8)], b"n")
    with pytest.raises(TransferError, match=r"127\.0\.0\.1:\d+"):
        b.wait(h, timeout=10)
    b.release(h)


def test_many_concurrent_reads(two):
    a, b = two
    handles = [b.start_read("a", [ReadDesc(0, i * 16, i * 16, 16)], f"r{i}".encode())
               for i in range(16)]
    for h in handles:
        b.wait(h)
        b.release(h)
    assert sorted(wait_notifications(a, 16)) == sorted(f"r{i}".encode() for i in range(16))
    assert torch.equal(b._flat[0][:256], a._flat[0][:256])
    assert b._flat[0][256:].count_nonzero() == 0


def test_metadata_is_json(two):
    a, _ = two
    md = a.metadata()
    assert json.loads(json.dumps(md)) == md


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_regions_are_staged():
    a, b = TcpTransport(), TcpTransport()
    try:
        src = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
        dst = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
        a.register([src])
        b.register([dst])
        b.add_peer("a", a.metadata())
        h = b.start_read("a", [ReadDesc(0, 4096, 8192, 4096), ReadDesc(0, 0, 0, 1024)], b"c")
        b.wait(h)
        b.release(h)
        assert torch.equal(dst[2048:3072], src[1024:2048]) and torch.equal(dst[:256], src[:256])
        assert dst[256:2048].count_nonzero() == 0
    finally:
        b.close()
        a.close()
