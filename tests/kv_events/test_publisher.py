"""The engine core's publisher against real ZMQ sockets on 127.0.0.1: vLLM's framing and
replay protocol, a subscriber (kvrelay/proxy/kv_events.py) that joins late, fills gaps by
replay and notices a restarted publisher, and a full queue that drops without blocking."""
from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvrelay.kv_cache.events import Cleared, Removed, Stored  # noqa: E402
from kvrelay.kv_events.config import KVEventsConfig  # noqa: E402
from kvrelay.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kvrelay.kv_events.wire import (  # noqa: E402
    END_SEQ,
    GroupSpec,
    WireFormat,
    decode_batch,
    external_hash,
)
from kvrelay.proxy.kv_events import KVEventSubscriber  # noqa: E402
from kvrelay.proxy.kv_view import prefix_keys  # noqa: E402
from tests.processes import free_port  # noqa: E402

B = 2
WIRE = WireFormat(B, [GroupSpec.of_window(None)])


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def config(pub: int, replay: int | None, **kw) -> KVEventsConfig:
    """Loopback only: the PUB socket connects to a subscriber that binds (vLLM's rule for a
    host that is not a wildcard); the replay ROUTER binds 127.0.0.1."""
    return KVEventsConfig.from_json({"enable_kv_cache_events": True,
                                     "endpoint": f"tcp://127.0.0.1:{pub}", "topic": "kv@p@m",
                                     **({"replay_endpoint": f"tcp://127.0.0.1:{replay}"}
                                        if replay else {}), **kw})


def wait_for(cond, timeout=10.0, sub: KVEventSubscriber | None = None):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        if sub is not None:
            sub.poll(0.05)
        else:
            time.sleep(0.02)


def store(i: int, parent: int | None = None) -> Stored:
    return Stored(0, [h(i)], None if parent is None else h(parent), [i, i])


NUDGE = [Removed(0, h(10**6))]          # removes a block nobody stored: advances seq only


def settle(p: ZmqEventPublisher, s: KVEventSubscriber, name: str, timeout=20.0) -> None:
    """Until `s` has applied every batch `p` published. A PUB socket that is still
    connecting (ZMQ's slow joiner) drops what it sends; a no-op batch shows the subscriber
    the gap, which it fills by replay."""
    deadline = time.monotonic() + timeout
    while True:
        wait_for(lambda: p.published == p.queued, timeout)

        def done() -> bool:
            return s.view(name).next_seq == p._seq and s._backends[name].replay_since is None

        end = time.monotonic() + 0.5
        while time.monotonic() < end and not done():
            s.poll(0.05)
        if done():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled: {s.view(name).next_seq} < {p._seq}")
        p.publish(NUDGE)


def first_live(p: ZmqEventPublisher, sub) -> int:
    """Nudges until the raw SUB socket `sub` receives one (the PUB has connected); its seq."""
    for _ in range(100):
        p.publish(NUDGE)
        if sub.poll(200):
            seq = int.from_bytes(sub.recv_multipart()[1], "big")
            while sub.poll(200):                      # nudges still in flight
                seq = int.from_bytes(sub.recv_multipart()[1], "big")
            return seq
    raise AssertionError("the PUB socket never connected")


@pytest.fixture
def ports():
    return free_port(), free_port()


def test_framing_and_replay_are_vllms(ports):
    """Live: [topic, 8-byte big-endian seq, payload]. Replay (a DEALER): one message per
    batch from the start seq, [b"", topic, seq, payload], then [b"", b"", -1, b""]. A REQ
    socket (vLLM's own test subscriber uses one) reads only the first: ZMQ's REQ takes one
    reply per request."""
    pub_port, replay_port = ports
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(f"tcp://127.0.0.1:{pub_port}")
    p = ZmqEventPublisher(config(pub_port, replay_port), WIRE)
    try:
        base = first_live(p, sub) + 1
        for i in range(4):
            assert p.publish([store(i)])
        for i in range(4):
            assert sub.poll(10_000)
            topic, seq_bytes, payload = sub.recv_multipart()
            assert (topic, seq_bytes) == (b"kv@p@m", (base + i).to_bytes(8, "big"))
            assert decode_batch(payload).events[0].block_hashes == [external_hash(h(i))]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (base + 2).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10_000)
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            empty, topic, seq_bytes, payload = frames
            assert (empty, topic) == (b"", b"kv@p@m")
            got.append((int.from_bytes(seq_bytes, "big"),
                        decode_batch(payload).events[0].block_hashes))
        assert got == [(base + 2, [external_hash(h(2))]), (base + 3, [external_hash(h(3))])]
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send((base + 1).to_bytes(8, "big"))
        assert req.poll(10_000)
        assert req.recv_multipart()[:2] == [b"kv@p@m", (base + 1).to_bytes(8, "big")]
        assert not req.poll(300)
    finally:
        p.shutdown()
        ctx.destroy(linger=0)


def test_a_late_subscriber_replays_then_follows(ports):
    p = ZmqEventPublisher(config(*ports), WIRE)
    s = KVEventSubscriber("kv@")
    try:
        for i in range(5):                               # nobody listening yet: PUB drops them
            p.publish([store(i, i - 1 if i else None)])
        p.publish([Removed(0, h(1))])
        wait_for(lambda: p.published == 6)
        s.add_backend("a", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}",
                      bind=True)
        wait_for(lambda: s.view("a").next_seq == 6, sub=s)      # the replay alone
        assert s.blocks("a") == {(0, external_hash(h(i))) for i in (0, 2, 3, 4)}
        p.publish([Cleared(), store(9)])
        settle(p, s, "a")
        assert s.blocks("a") == {(0, external_hash(h(9)))}
        assert s.view("a").stats.lost == 0
    finally:
        s.close()
        p.shutdown()


def test_prefix_queries_follow_the_token_chain(ports):
    p = ZmqEventPublisher(config(*ports), WIRE)
    s = KVEventSubscriber()
    s.add_backend("a", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", bind=True)
    try:
        tokens = [5, 6, 7, 8, 9, 10, 11]
        p.publish([Stored(0, [h(1), h(2)], None, tokens[:4])])
        p.publish([Stored(0, [h(3)], h(2), tokens[4:6])])
        settle(p, s, "a")
        assert s.cached_prefix_blocks("a", tokens) == 3
        assert s.cached_prefix_blocks("a", tokens[:3] + [0, 9, 10]) == 1
        p.publish([Removed(0, h(2))])
        settle(p, s, "a")
        assert s.cached_prefix_blocks("a", tokens) == 1       # the chain breaks at block 1
        assert (0, prefix_keys(tokens, B)[2]) in s.view("a").keys
    finally:
        s.close()
        p.shutdown()


class _SlowWire(WireFormat):
    """Encodes only when allowed: holds the publisher thread so its queue fills."""
    gate = threading.Event()

    def encode(self, ts, events, data_parallel_rank):
        self.gate.wait(10)
        return super().encode(ts, events, data_parallel_rank)


def test_a_full_queue_drops_without_blocking_and_leaves_a_gap(ports):
    wire = _SlowWire(B, [GroupSpec.of_window(None)])
    p = ZmqEventPublisher(config(*ports, max_queue_size=1), wire)
    s = KVEventSubscriber()
    s.add_backend("a", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", bind=True)
    try:
        assert p.publish([store(0)])                     # the thread takes it, waits in encode
        wait_for(lambda: p._queue.empty())
        assert p.publish([store(1)])                     # fills the queue
        started = time.monotonic()
        assert not p.publish([store(2)])                 # full: dropped, at once
        assert time.monotonic() - started < 0.1 and p.dropped == 1
        _SlowWire.gate.set()
        wait_for(lambda: p.published == 2)
        assert p.publish([store(3)])                     # seq 3: 2 is skipped
        wait_for(lambda: p.published == 3)
        settle(p, s, "a")                                # seq 2 was skipped: 0, 1, 3
        assert s.view("a").stats.lost == 1
        assert s.blocks("a") == {(0, external_hash(h(i))) for i in (0, 1, 3)}
    finally:
        _SlowWire.gate.set()
        s.close()
        p.shutdown()


def test_a_restarted_publisher_clears_the_view(ports):
    s = KVEventSubscriber()
    s.add_backend("a", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", bind=True)
    p = ZmqEventPublisher(config(*ports), WIRE)
    try:
        for i in range(20):          # so the new publisher's first seqs fall below
            p.publish([store(i)])
        settle(p, s, "a")
        seen = p._seq
        p.shutdown()
        p = ZmqEventPublisher(config(*ports), WIRE)      # a new engine: empty cache, seq from 0
        p.publish([store(7)])
        p.publish([store(8)])                            # lost: nobody polls the SUB socket yet
        wait_for(lambda: p.published == 2)
        assert p._seq < seen
        # no further batch: the new connection itself triggers a replay from 0, whose
        # batches are later than anything applied under those seqs
        want = {(0, external_hash(h(7))), (0, external_hash(h(8)))}
        wait_for(lambda: s.blocks("a") == want, sub=s)
        assert s.view("a").stats.restarts == 1 and s.view("a").next_seq == 2
    finally:
        s.close()
        p.shutdown()


def _raw_publisher() -> tuple[int, int, zmq.Context, zmq.Socket, zmq.Socket]:
    """A fake publisher's sockets: PUB connecting to a subscriber's port, ROUTER replay."""
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    return pub_port, replay_port, ctx, pub, router


def test_gaps_are_filled_by_replay():
    """A fake publisher (raw sockets) skips seq 1 on the live stream; the subscriber asks
    the replay socket for it and applies 1, 2 in order."""
    pub_port, replay_port, ctx, pub, router = _raw_publisher()
    payloads = [WIRE.encode(0.0, [store(i)], 0) for i in range(3)]
    published: list[bytes] = []                      # what the fake has published so far
    s = KVEventSubscriber(idle_replay_s=None)        # the replays counted are the gap's
    s.add_backend("a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                  bind=True)
    try:
        def serve_replay():
            assert router.poll(5000)
            client, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(published)):
                router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"),
                                       published[seq]])
            router.send_multipart([client, b"", b"", END_SEQ, b""])

        serve_replay()                                   # the join: nothing published yet
        wait_for(lambda: s._backends["a"].replay_since is None, sub=s)
        published.extend(payloads)
        for _ in range(100):                             # seq 0 until the PUB has connected
            pub.send_multipart([b"", (0).to_bytes(8, "big"), payloads[0]])
            s.poll(0.1)
            if s.view("a").next_seq == 1:
                break
        assert s.view("a").stats.replays == 1
        pub.send_multipart([b"", (2).to_bytes(8, "big"), payloads[2]])     # 1 never arrives
        threading.Thread(target=serve_replay).start()
        wait_for(lambda: s.view("a").next_seq == 3, sub=s)
        assert s.view("a").stats.replays == 2 and s.view("a").stats.lost == 0
        assert s.blocks("a") == {(0, external_hash(h(i))) for i in range(3)}
    finally:
        s.close()
        pub.close(0)
        router.close(0)
        ctx.destroy(linger=0)


def test_replicas_publish_on_offset_ports_with_their_rank():
    base, replay = free_port(), free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{base + 1}")
    try:
        p = ZmqEventPublisher(config(base, replay), WIRE, data_parallel_rank=1)
    except ValueError:
        pytest.skip("the neighbouring ports are in use")
    try:
        assert p.replay_endpoint == f"tcp://127.0.0.1:{replay + 1}"
        first_live(p, sub)
        p.publish([store(1)])
        assert sub.poll(10_000)
        assert decode_batch(sub.recv_multipart()[2]).data_parallel_rank == 1
    finally:
        p.shutdown()
        sub.close(0)
        ctx.destroy(linger=0)


def test_a_busy_replay_port_is_a_clear_error(ports):
    blocker = zmq.Context().socket(zmq.ROUTER)
    blocker.bind(f"tcp://127.0.0.1:{ports[1]}")
    try:
        with pytest.raises(ValueError, match="--kv-events-config: cannot open"):
            ZmqEventPublisher(config(*ports), WIRE)
    finally:
        blocker.close(0)


def test_a_restart_seen_through_a_gap_is_recognised_by_the_replayed_batch():
    """The new publisher's first batches were lost (its seq already past the old one's):
    the gap's replay starts one batch early, and that batch's timestamp differs from the
    one applied under its seq, so the view is rebuilt from the new publisher's seq 0."""
    pub_port, replay_port, ctx, pub, router = _raw_publisher()
    old = [WIRE.encode(1.0 + i, [store(i)], 0) for i in range(3)]
    new = [WIRE.encode(100.0 + i, [store(50 + i)], 0) for i in range(6)]
    buffer = old
    s = KVEventSubscriber(idle_replay_s=None)        # the fake answers two replays
    s.add_backend("a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                  bind=True)

    def serve_replays(n):
        for _ in range(n):
            assert router.poll(10_000)
            client, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(buffer)):
                router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), buffer[seq]])
            router.send_multipart([client, b"", b"", END_SEQ, b""])

    try:
        serve_replays(1)                                 # the join replays the old 0..2
        wait_for(lambda: s.view("a").next_seq == 3, sub=s)
        buffer = new                                     # restarted; its 0..4 never arrived
        server = threading.Thread(target=serve_replays, args=(2,))
        server.start()
        for _ in range(50):
            pub.send_multipart([b"", (5).to_bytes(8, "big"), new[5]])
            s.poll(0.1)
            if s.view("a").stats.restarts:
                break
        wait_for(lambda: s.view("a").next_seq == 6, sub=s)
        server.join(10)
        assert s.view("a").stats.restarts == 1
        assert s.blocks("a") == {(0, external_hash(h(50 + i))) for i in range(6)}
    finally:
        s.close()
        pub.close(0)
        router.close(0)
        ctx.destroy(linger=0)


def test_an_idle_subscriber_fetches_a_lost_tail_by_replay(ports):
    """The last batch of a burst lost on the way (nothing after it shows the gap): the idle
    replay fetches it."""
    p = ZmqEventPublisher(config(*ports), WIRE)
    s = KVEventSubscriber(idle_replay_s=0.2)
    s.add_backend("a", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", bind=True)
    try:
        settle(p, s, "a")
        s._backends["a"].sub.setsockopt(zmq.UNSUBSCRIBE, b"")   # deaf to the live stream
        p.publish([store(5)])
        wait_for(lambda: p.published == p.queued)
        wait_for(lambda: (0, external_hash(h(5))) in s.blocks("a"), sub=s)
        assert s.view("a").stats.lost == 0
    finally:
        s.close()
        p.shutdown()
