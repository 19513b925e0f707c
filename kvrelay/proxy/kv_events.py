"""A KV-event subscriber: each backend's cached blocks (`BackendView`, kv_view.py), rebuilt
from its `--kv-events-config` stream (kvrelay's or vLLM's). The proxy's feed of them into
cache-aware routing (`kvrelay proxy --kv-events-port`) is kv_events_feed.py.

Per backend one SUB socket (topic filter) and, when the backend has a replay endpoint, one
DEALER socket for replays. Sequence numbers keep the view exact:

    start            replay from 0: whatever the publisher still buffers (batches it no
                     longer has count as lost)
    seq == next      apply
    seq >  next      a gap (a slow join, a dropped message): replay from `next - 1`; live
                     messages wait until the replay's end marker, then apply in order. The
                     one batch seen before is a check: a different timestamp under its seq
                     means a new publisher (below)
    seq <  next      (live) the publisher restarted: its cache is empty, so is the view;
                     replay from 0
    unfillable gap   (the replay buffer no longer has it, or no replay endpoint) counted in
                     `lost`: the view may be missing blocks or keep evicted ones from then on
    idle             every `idle_replay_s` without a message, a replay from `next - 1`: the
                     last batches of a burst, lost with nothing after them to show the gap,
                     are fetched, and a restarted publisher that got past `next` is noticed

Each stored block is kept under (group, engine hash) and under the proxy's own prefix key
(kv_view.py), so a router can ask how many leading blocks of a prompt a backend holds
(`cached_prefix_blocks`, or with the keys already computed, `cached_prefix_keys`) without
knowing the engine's hash function (what llm-d does with vLLM's events).

Threads: one thread adds backends and calls `poll` (which may block up to its timeout),
and should call it continually: ZMQ hands a SUB socket a newly connected publisher (and
sends it the subscription) only while the socket is in use, so a publisher that connects
to a bound subscriber nobody polls drops its first batches (the replay then recovers
them). The queries may come from any thread: `poll` waits outside `lock` and applies each
message under it, the queries read under it. With `keys` (kv_events/curve.py) every socket
is a CURVE client of the key derived from the KV secret. pyzmq is imported when the first
backend is added.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.kv_events.curve import CurveKeys, make_client
from kvrelay.kv_events.wire import (
    END_SEQ,
    ExternalHash,
    WireBatch,
    WireError,
    decode_batch,
)
from kvrelay.proxy.kv_view import BackendView, prefix_keys
from kvrelay.proxy.prefix import BlockHash

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0           # a replay without its end marker by then is given up
_SEEN = 64                       # timestamps of the last batches applied, to recognise them


@dataclass
class _Backend:
    view: BackendView
    sub: Any
    replay: Any | None
    monitor: Any = None                        # the SUB socket's connection events
    connections: int = 0                       # connections the SUB socket has seen
    replay_since: float | None = None          # a replay in flight, sent at (monotonic)
    replay_again: bool = False                 # replay from 0 once this one ends
    last_heard: float = 0.0                    # the last message or request (monotonic)
    waiting: list[tuple[int, WireBatch]] = field(default_factory=list)  # live, held meanwhile
    restarted: bool = False                    # this replay showed a new publisher
    probing: bool = False                      # the replay in flight is an idle one


class KVEventSubscriber:
    """Follows the KV events of any number of backends; `poll` applies what arrived."""

    def __init__(self, topic: str = "", idle_replay_s: float | None = 2.0,
                 keys: CurveKeys | None = None) -> None:
        self.topic = topic.encode()
        self.idle_replay_s = idle_replay_s
        self.keys = keys
        self.lock = threading.Lock()           # the views: written by `poll`, read by queries
        self._zmq: Any = None
        self._ctx: Any = None
        self._poller: Any = None
        self._backends: dict[str, _Backend] = {}
        self._by_socket: dict[Any, tuple[_Backend, str]] = {}     # → (backend, kind)

    # -- backends -------------------------------------------------------------------------------
    def add_backend(self, name: str, endpoint: str, replay_endpoint: str | None = None,
                    bind: bool = False) -> BackendView:
        """Follow `name`'s events: SUB connects to `endpoint` (a server that binds, e.g.
        tcp://HOST:5557) or, with `bind`, binds it (for a server whose endpoint connects to
        this subscriber); with `replay_endpoint`, replays from 0 at once."""
        if name in self._backends:
            raise ValueError(f"backend {name!r} is already followed")
        zmq = self._zmq_module()
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        (sub.bind if bind else sub.connect)(endpoint)
        replay = None
        if replay_endpoint is not None:
            replay = self._socket(zmq.DEALER)
            replay.connect(replay_endpoint)
        backend = _Backend(BackendView(name), sub, replay)
        self._backends[name] = backend
        self._by_socket[sub] = (backend, "live")
        self._poller.register(sub, zmq.POLLIN)
        if replay is not None:
            # a second connection may be a restarted publisher: replay from 0 then
            backend.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
            for sock, kind in ((replay, "replay"), (backend.monitor, "monitor")):
                self._by_socket[sock] = (backend, kind)
                self._poller.register(sock, zmq.POLLIN)
            self._request_replay(backend, 0)
        return backend.view

    def _socket(self, kind: int) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        if self.keys is not None:
            make_client(sock, self.keys)
        return sock

    def remove_backend(self, name: str) -> None:
        backend = self._backends.pop(name)
        if backend.monitor is not None:
            backend.sub.disable_monitor()
        for sock in (backend.monitor, backend.sub, backend.replay):
            if sock is not None:
                self._poller.unregister(sock)
                del self._by_socket[sock]
                sock.close(linger=0)

    def view(self, name: str) -> BackendView:
        return self._backends[name].view

    def __len__(self) -> int:
        return len(self._backends)

    def reset_backend(self, name: str) -> None:
        """Forget `name`'s blocks and replay (e.g. after its health check failed)."""
        backend = self._backends[name]
        backend.view.clear()
        backend.view.next_seq = 0
        if backend.replay is not None:
            self._request_replay(backend, 0)

    def close(self) -> None:
        for name in list(self._backends):
            self.remove_backend(name)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._zmq = self._ctx = self._poller = None

    # -- queries ----------------------------------------------------------------------------------
    def blocks(self, name: str) -> set[tuple[int, ExternalHash]]:
        """(group, engine hash) of every block `name` holds, as its events say."""
        with self.lock:
            return set(self._backends[name].view.blocks)

    def cached_prefix_blocks(self, name: str, token_ids: Sequence[int], group: int = 0) -> int:
        """How many leading full blocks of `token_ids` `name` holds in `group`."""
        block_size = self._backends[name].view.block_size
        if not block_size:
            return 0
        return self.cached_prefix_keys(name, prefix_keys(token_ids, block_size), group)

    def cached_prefix_keys(self, name: str, keys: Sequence[BlockHash], group: int = 0) -> int:
        """How many of `keys` (a prompt's block keys, `prefix_keys`), from the first, `name`
        holds in `group`."""
        with self.lock:
            held = self._backends[name].view.keys
            n = 0
            for key in keys:
                if (group, key) not in held:
                    break
                n += 1
            return n

    def synced(self, name: str, within_s: float, now: float | None = None) -> bool:
        """`name`'s view is current: joined, no gap being filled (an idle replay may be in
        flight), and a message (live or a replay's answer) came within `within_s`."""
        backend = self._backends[name]
        now = time.monotonic() if now is None else now
        return ((backend.replay_since is None or backend.probing)
                and backend.view.last_message > 0
                and now - backend.view.last_message <= within_s)

    # -- the event loop ----------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Wait up to `timeout_s` for messages, apply everything that arrived; the number of
        messages read."""
        if self._poller is None:
            return 0
        read = 0
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        while ready:
            for sock in ready:
                backend, kind = self._by_socket[sock]
                frames = sock.recv_multipart()
                with self.lock:
                    read += self._on_message(backend, kind, frames)
            ready = dict(self._poller.poll(0))
        with self.lock:
            self._expire_replays()
        return read

    def _on_message(self, backend: _Backend, kind: str, frames: list[bytes]) -> int:
        if kind == "monitor":
            self._on_connection(backend)
            return 0
        backend.last_heard = backend.view.last_message = time.monotonic()
        if kind == "replay":
            self._on_replay(backend, frames)
        else:
            self._on_live(backend, frames)
        return 1

    def _on_connection(self, backend: _Backend) -> None:
        backend.connections += 1
        if backend.connections == 1:
            return
        if backend.replay_since is None:
            self._request_replay(backend, 0)
        else:
            backend.replay_again = True

    def _on_live(self, backend: _Backend, frames: list[bytes]) -> None:
        if len(frames) != 3:
            backend.view.stats.errors += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        batch = self._decode(backend, payload)
        if batch is None:
            return
        view = backend.view
        if backend.replay_since is not None:
            backend.waiting.append((seq, batch))
        elif seq == view.next_seq:
            self._apply(backend, seq, batch)
        elif seq > view.next_seq:
            if backend.replay is not None:
                backend.waiting.append((seq, batch))
                check = view.next_seq - 1 if view.next_seq - 1 in view.seen_ts else view.next_seq
                self._request_replay(backend, check)
            else:
                self._catch_up(backend, seq, batch)
        else:                                   # the sequence went back: a new publisher
            self._restarted(backend, seq)
            if backend.replay is not None and seq > 0:
                backend.waiting.append((seq, batch))
                self._request_replay(backend, 0)
            else:
                self._catch_up(backend, seq, batch)

    def _restarted(self, backend: _Backend, seq: int) -> None:
        view = backend.view
        logger.info("KV events of %s: batch %d is not the one applied under that sequence "
                    "number (next %d): the publisher restarted; its view is rebuilt",
                    view.name, seq, view.next_seq)
        view.stats.restarts += 1
        view.clear()
        view.next_seq = 0

    def _on_replay(self, backend: _Backend, frames: list[bytes]) -> None:
        body = frames[1:] if frames and frames[0] == b"" else frames
        if len(body) < 2:
            backend.view.stats.errors += 1
            return
        seq_bytes, payload = body[-2], body[-1]
        if seq_bytes == END_SEQ or not payload:
            self._replay_done(backend)
            return
        if backend.replay_since is None or backend.restarted:   # given up on / superseded
            return
        batch = self._decode(backend, payload)
        if batch is None:
            return
        seq = int.from_bytes(seq_bytes, "big")
        if backend.view.is_new_publisher(seq, batch):
            self._restarted(backend, seq)
            backend.restarted = True            # the rest of this replay is stale
            return
        self._catch_up(backend, seq, batch)

    def _replay_done(self, backend: _Backend) -> None:
        if backend.restarted or backend.replay_again:  # start over from the new seq 0
            backend.restarted = backend.replay_again = False
            self._request_replay(backend, 0)
            return
        backend.replay_since = None
        backend.probing = False
        waiting, backend.waiting = sorted(backend.waiting, key=lambda w: w[0]), []
        for i, (seq, batch) in enumerate(waiting):
            if backend.view.is_new_publisher(seq, batch) and backend.replay is not None:
                self._restarted(backend, seq)
                backend.waiting = waiting[i:]
                self._request_replay(backend, 0)
                return
            self._catch_up(backend, seq, batch)

    def _catch_up(self, backend: _Backend, seq: int, batch: WireBatch) -> None:
        """A batch from a replay or held back during one: apply it unless already applied;
        a batch past `next_seq` means the ones between are gone for good."""
        view = backend.view
        if seq < view.next_seq:
            return
        if seq > view.next_seq:
            view.stats.lost += seq - view.next_seq
            logger.warning("KV events of %s: batches %d..%d are lost (not in the replay "
                           "buffer); its view may be inexact", view.name, view.next_seq, seq - 1)
        self._apply(backend, seq, batch)

    def _apply(self, backend: _Backend, seq: int, batch: WireBatch) -> None:
        view = backend.view
        view.apply(batch)
        view.next_seq = seq + 1
        view.seen_ts[seq] = view.last_ts = batch.ts
        if len(view.seen_ts) > _SEEN:
            view.seen_ts.popitem(last=False)

    def _request_replay(self, backend: _Backend, start: int) -> None:
        assert backend.replay is not None
        backend.replay.send_multipart((b"", start.to_bytes(8, "big")))
        backend.replay_since = backend.last_heard = time.monotonic()
        backend.probing = False
        backend.view.stats.replays += 1

    def _expire_replays(self) -> None:
        now = time.monotonic()
        for backend in self._backends.values():
            if backend.replay_since is not None and now - backend.replay_since > REPLAY_TIMEOUT_S:
                logger.warning("KV events of %s: no answer to a replay within %.0f s",
                               backend.view.name, REPLAY_TIMEOUT_S)
                self._replay_done(backend)
            elif (backend.replay is not None and backend.replay_since is None
                  and self.idle_replay_s is not None
                  and now - backend.last_heard > self.idle_replay_s):
                view = backend.view
                start = view.next_seq - 1 if view.next_seq - 1 in view.seen_ts else view.next_seq
                self._request_replay(backend, start)
                backend.probing = True

    def _decode(self, backend: _Backend, payload: bytes) -> WireBatch | None:
        try:
            return decode_batch(payload)
        except WireError as e:
            backend.view.stats.errors += 1
            logger.warning("KV events of %s: undecodable batch: %s", backend.view.name, e)
            return None

    def _zmq_module(self) -> Any:
        if self._zmq is None:
            try:
                import zmq
            except ImportError:
                raise RuntimeError("following KV events needs pyzmq (pip install pyzmq)") from None
            self._zmq, self._ctx, self._poller = zmq, zmq.Context(), zmq.Poller()
        return self._zmq
