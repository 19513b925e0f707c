"""The engine core's KV-event publisher: vLLM's ZmqEventPublisher protocol, never blocking a step.

    engine step ──publish(events)──▶ bounded queue ──▶ publisher thread:
        seq (from 0), encode (wire.py), PUB [topic, seq, payload], keep (seq, payload) in the
        replay buffer (the last buffer_steps batches); between batches answer replay
        requests on the ROUTER socket

`publish` is `put_nowait`: a full queue drops the step's batch and counts it (`dropped`),
and the publisher skips as many sequence numbers, so a subscriber sees the gap (replay
cannot fill it: the batch never existed there). vLLM blocks the scheduler instead.

Sockets (vLLM's rules, config.py): the PUB socket binds an endpoint with a wildcard host
(`*`, `::`) or an ipc:// / inproc:// one and connects to any other (a subscriber that binds,
e.g. an indexer); the ROUTER replay socket always binds. kvrelay's differences: an unset
endpoint binds 127.0.0.1:5557, `"bind": true` binds a named interface, and events that
leave loopback without `"auth": "kv_secret"` (CURVE, curve.py) cost one WARNING line.
A replay request is [identity, b"", start seq (8 bytes, big-endian)]; the answer, one
message per buffered batch with seq ≥ start, [identity, b"", topic, seq, payload], then
[identity, b"", b"", END_SEQ, b""].

The sockets are made (and bound: a busy port fails the engine's start-up) in the caller's
thread and then used only by the publisher thread. pyzmq is imported here only.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvrelay import envs
from kvrelay.kv_cache.events import CacheEvent
from kvrelay.kv_events.config import KVEventsConfig
from kvrelay.kv_events.curve import Admitter, CurveKeys, make_server, publisher_keys
from kvrelay.kv_events.wire import ENCODINGS, END_SEQ, GroupSpec, WireFormat

logger = logging.getLogger(__name__)

_POLL_S = 0.05               # how long the thread waits for a batch before serving replays again


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, wire: WireFormat,
                 data_parallel_rank: int = 0) -> None:
        try:
            import zmq
        except ImportError:
            raise ValueError("--kv-events-config with the zmq publisher needs pyzmq "
                             "(pip install pyzmq)") from None
        self._zmq = zmq
        config = config.for_rank(data_parallel_rank)
        self.config, self.wire, self.rank = config, wire, data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[CacheEvent], int]] = queue.Queue(
            config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        keys = publisher_keys(config)                # ValueError: no secret, no CURVE
        self._ctx = zmq.Context()
        # the ZAP handler runs before any socket listens, so no handshake slips past it
        self.admitter = Admitter(self._ctx, keys) if keys is not None else None
        self._pub: Any = None
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        try:
            self._open(config, keys)
        except zmq.ZMQError as e:
            self._close_context()
            raise ValueError(f"--kv-events-config: cannot open {config.pub_endpoint!r} / "
                             f"{config.replay_endpoint!r}: {e}") from None
        self._seq = 0
        self._skipped = 0                 # batches dropped since the last one queued
        self.queued = 0                   # batches accepted by `publish`
        self.dropped = 0                  # batches dropped in all (queue full)
        self.published = 0                # batches sent (or failed to encode / send)
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher",
                                        daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s (%s)%s, topic %r, data-parallel rank "
                    "%d, %s", self.endpoint, "bound" if config.pub_binds else "connected",
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
                    config.topic, data_parallel_rank,
                    "CURVE keyed from the KV secret" if keys else "unauthenticated")
        warn_if_exposed(config)

    def _open(self, config: KVEventsConfig, keys: CurveKeys | None) -> None:
        zmq = self._zmq
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            make_server(self._pub, keys)
        if config.pub_binds:
            self._pub.bind(config.pub_endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(config.pub_endpoint)
            self.endpoint = config.pub_endpoint
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # a whole replay and its end marker fit (ZMQ acks reads every HWM/2 messages)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            if keys is not None:
                make_server(self._replay, keys)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_context(self) -> None:
        if self.admitter is not None:
            self.admitter.stop()
        self._ctx.destroy(linger=0)

    # -- the engine's side (never blocks) ------------------------------------------------------
    def publish(self, events: list[CacheEvent]) -> bool:
        """Queue one step's events; False (counted in `dropped`) when the queue is full."""
        try:
            self._queue.put_nowait((time.time(), events, self._skipped))
        except queue.Full:
            self._skipped += 1
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV cache events: the publisher queue is full (max_queue_size "
                               "%d); %d batch(es) dropped so far, subscribers see a sequence "
                               "gap", self.config.max_queue_size, self.dropped)
            return False
        self._skipped = 0
        self.queued += 1
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV cache events: the publisher thread did not stop within %.1f s",
                           timeout)
            return                                   # its sockets stay with it (a daemon)
        self._close_context()

    # -- the publisher thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._serve_replays()
            try:
                ts, events, skipped = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                self._send(ts, events, skipped)
            except Exception:  # noqa: BLE001 -- a bad batch must not end the publisher
                logger.exception("KV cache events: publishing a batch failed")
            finally:
                self.published += 1

    def _send(self, ts: float, events: Sequence[CacheEvent], skipped: int) -> None:
        self._seq += skipped                         # dropped batches leave a visible gap
        payload = self.wire.encode(ts, events, self.rank)
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload), copy=False)
        self._buffer.append((self._seq, payload))
        self._seq += 1

    def _serve_replays(self) -> None:
        zmq = self._zmq
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV cache events: malformed replay request (%d frames)",
                               len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        self._replay.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                            flags=zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("KV cache events: a replay client is not reading; its replay "
                               "was cut short")


def warn_if_exposed(config: KVEventsConfig) -> None:
    """One WARNING line when unauthenticated events can be read beyond this host: a
    wildcard or non-loopback bind, or a connect to another host, without `"auth"`."""
    exposed = config.exposed()
    if exposed and config.auth is None:
        logger.warning("KV cache events on %s are unauthenticated and carry the token ids of "
                       "cached prompts (other clients' too): anyone who reaches them reads "
                       "those; bind loopback or a private interface, or set \"auth\": "
                       "\"kv_secret\" (docs/security.md)", " and ".join(exposed))


def make_publisher(config: KVEventsConfig | None, block_size: int, groups: Sequence[GroupSpec],
                   data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """An engine's publisher (hash form and event encoding from KVRELAY_KV_EVENTS_*), or
    None when events are off (or the null publisher)."""
    if config is None or not config.active:
        return None
    int_hashes = envs.KV_EVENTS_INT_HASHES.raw()
    if int_hashes not in ("0", "1"):
        raise ValueError(f"{envs.KV_EVENTS_INT_HASHES.shown}: expected 0 or 1, got "
                         f"{int_hashes!r}")
    encoding = envs.KV_EVENTS_ENCODING.raw() or "map"
    if encoding not in ENCODINGS:
        raise ValueError(f"{envs.KV_EVENTS_ENCODING.shown}: expected one of "
                         f"{', '.join(ENCODINGS)}, got {encoding!r}")
    wire = WireFormat(block_size, groups, int_hashes=int_hashes == "1", encoding=encoding)
    return ZmqEventPublisher(config, wire, data_parallel_rank)
