"""Who can read the KV events: the default endpoint binds loopback only, a stream that leaves
loopback unauthenticated costs one warning line, and with `"auth": "kv_secret"` (CURVE keyed
from the KV secret) only a subscriber holding that secret receives anything — live or by
replay."""
from __future__ import annotations

import logging
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvrelay.kv_cache.events import Stored  # noqa: E402
from kvrelay.kv_events import config as config_module  # noqa: E402
from kvrelay.kv_events.config import KVEventsConfig  # noqa: E402
from kvrelay.kv_events.curve import derive_keys, make_client  # noqa: E402
from kvrelay.kv_events.publisher import ZmqEventPublisher, warn_if_exposed  # noqa: E402
from kvrelay.kv_events.wire import GroupSpec, WireFormat, external_hash  # noqa: E402
from kvrelay.proxy.kv_events import KVEventSubscriber  # noqa: E402
from tests.processes import free_port  # noqa: E402

WIRE = WireFormat(2, [GroupSpec.of_window(None)])
SECRET = "the topology's KV secret"
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_the_default_endpoint_binds_loopback_only(monkeypatch, caplog):
    """No endpoint given: bound, on 127.0.0.1 (the socket's own LAST_ENDPOINT says so), and
    no warning. (The default's port, 5557, is pinned in test_wire.py; a free one here.)"""
    port = free_port()
    monkeypatch.setattr(config_module, "DEFAULT_ENDPOINT", f"tcp://127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, "kvrelay.kv_events.publisher"):
        p = ZmqEventPublisher(KVEventsConfig.from_json({"enable_kv_cache_events": True}), WIRE)
    try:
        assert p._pub.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"
        assert p.endpoint == f"tcp://127.0.0.1:{port}"
        assert not caplog.records
    finally:
        p.shutdown()


def test_an_unauthenticated_stream_beyond_loopback_warns_once(caplog):
    """A wildcard bind, a named interface bound with "bind": true, or a connect to another
    host: one WARNING line naming the endpoints, the missing auth and the token ids. With
    "auth" or on loopback: none."""
    cases = [({"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://0.0.0.0:5558"}, True),
             ({"endpoint": "tcp://10.0.0.5:5557", "bind": True}, True),
             ({"endpoint": "tcp://10.0.0.5:5557"}, True),                  # connects out
             ({"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"},
              False),
             ({}, False)]
    for raw, warns in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, "kvrelay.kv_events.publisher"):
            warn_if_exposed(KVEventsConfig.from_json({"enable_kv_cache_events": True, **raw}))
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == int(warns), (raw, lines)
        if warns:
            assert "unauthenticated" in lines[0] and "token ids" in lines[0]
            assert raw["endpoint"] in lines[0]


def test_an_exposed_stream_with_auth_does_not_warn(caplog, monkeypatch):
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    with caplog.at_level(logging.WARNING, "kvrelay.kv_events.publisher"):
        warn_if_exposed(KVEventsConfig.from_json({"enable_kv_cache_events": True,
                                                  "endpoint": "tcp://*:5557",
                                                  "auth": "kv_secret"}))
    assert not caplog.records


def test_keys_are_derived_from_the_secret_alone():
    a, b, other = derive_keys(b"s"), derive_keys(b"s"), derive_keys(b"t")
    assert a == b and a.server_public != other.server_public
    assert a.server_public != a.client_public and len(a.server_public) == 40
    assert "secret" not in repr(a).replace("server_public", "").replace("client_public", "")
    assert a.server_secret.decode() not in repr(a)


def _follow(keys, pub: int, replay: int) -> KVEventSubscriber:
    s = KVEventSubscriber(idle_replay_s=0.3, keys=keys)
    s.add_backend("a", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    return s


@needs_curve
def test_curve_only_a_subscriber_with_the_secret_receives_events(monkeypatch):
    """A publisher with "auth": "kv_secret": the subscriber keyed from the same secret
    rebuilds the blocks (live and by replay); one with no key, one keyed from another
    secret and a raw SUB socket with the right server key but its own client key get
    nothing in the same time, not even a replay's end marker."""
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    pub, replay = free_port(), free_port()
    p = ZmqEventPublisher(KVEventsConfig.from_json({
        "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}", "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{replay}", "auth": "kv_secret"}), WIRE)
    keys = derive_keys(SECRET.encode())
    good = _follow(keys, pub, replay)
    strangers = [_follow(None, pub, replay), _follow(derive_keys(b"a guess"), pub, replay)]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    raw.curve_serverkey = keys.server_public                 # the public half is not enough
    raw.curve_publickey, raw.curve_secretkey = zmq.curve_keypair()
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(f"tcp://127.0.0.1:{pub}")
    try:
        p.publish([Stored(0, [h(1)], None, [1, 1])])         # before anyone joined: by replay
        want = {(0, external_hash(h(1))), (0, external_hash(h(2)))}
        deadline = time.monotonic() + 20
        while good.blocks("a") != want:
            assert time.monotonic() < deadline, good.blocks("a")
            if good.view("a").next_seq == 1 and p.published == 1:
                p.publish([Stored(0, [h(2)], h(1), [2, 2])])  # live, once joined
            good.poll(0.05)
            for s in strangers:
                s.poll(0)
        end = time.monotonic() + 1.5                         # several idle replays' worth
        while time.monotonic() < end:
            for s in strangers:
                s.poll(0.05)
        for s in strangers:
            assert s.view("a").stats.batches == 0 and s.blocks("a") == set()
            assert s.view("a").last_message == 0.0           # no answer of any kind
        assert not raw.poll(100)
        # the raw socket's handshake reached the key check (ZAP) and was refused there; the
        # strangers' failed before it (no CURVE at all; a server key that is not this one's)
        assert p.admitter is not None and p.admitter.refused >= 1
    finally:
        for s in [good, *strangers]:
            s.close()
        raw.close(0)
        ctx.destroy(linger=0)
        p.shutdown()


@needs_curve
def test_a_curve_client_cannot_read_a_plain_publisher():
    """The subscriber's keys do not downgrade: keyed, it reads no unauthenticated stream."""
    pub = free_port()
    p = ZmqEventPublisher(KVEventsConfig.from_json({
        "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}", "bind": True}),
        WIRE)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    make_client(sub, derive_keys(b"s"))
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    try:
        for _ in range(10):
            p.publish([Stored(0, [h(1)], None, [1, 1])])
            assert not sub.poll(100)
    finally:
        sub.close(0)
        ctx.destroy(linger=0)
        p.shutdown()


@needs_curve
def test_without_its_key_check_a_curve_socket_admits_nobody():
    """ZAP_ENFORCE_DOMAIN: a CURVE server whose key check (ZAP handler) is gone refuses every
    client, the keyed one too (libzmq's default would admit anyone)."""
    from kvrelay.kv_events.curve import make_server
    keys, port = derive_keys(b"s"), free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    make_server(pub, keys)                                   # and no Admitter in this context
    pub.bind(f"tcp://127.0.0.1:{port}")
    sub = ctx.socket(zmq.SUB)
    make_client(sub, keys)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(10):
            pub.send_multipart([b"", b"x"])
            assert not sub.poll(50)
    finally:
        sub.close(0)
        pub.close(0)
        ctx.destroy(linger=0)
