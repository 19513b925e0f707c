"""A KV-event subscriber: each backend's cached blocks, rebuilt from its `--kv-events-config`
stream (kvrelay's or vLLM's), for cache-aware routing. Not wired into the proxy app yet.

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

Each stored block is kept under (group, engine hash) and under a key of its own computed
from the tokens of its whole prefix (`prefix_key`, chained from the event's parent), so a
router can ask how many leading blocks of a prompt a backend holds (`cached_prefix_blocks`)
without knowing the engine's hash function (what llm-d does with vLLM's events).

Not thread-safe: one thread calls `poll` (which may block up to its timeout) and the
queries, and should call it continually: ZMQ hands a SUB socket a newly connected
publisher (and sends it the subscription) only while the socket is in use, so a publisher
that connects to a bound subscriber nobody polls drops its first batches (the replay
then recovers them). pyzmq is imported when the first backend is added.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.kv_events.wire import (
    END_SEQ,
    ExternalHash,
    WireBatch,
    WireCleared,
    WireError,
    WireRemoved,
    WireStored,
    decode_batch,
)

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0           # a replay without its end marker by then is given up
_SEEN = 64                       # timestamps of the last batches applied, to recognise them
_ROOT = hashlib.sha256(b"kvrelay-kv-events-prefix-v1").digest()


def prefix_key(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """This subscriber's name for a block: SHA-256 over its parent's key and its tokens
    (little-endian int64), chained from a fixed root. Equal prefixes, equal keys, whatever
    the engine's own hash."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the full blocks of `token_ids`."""
    keys: list[bytes] = []
    parent = None
    for b in range(len(token_ids) // block_size):
        parent = prefix_key(parent, token_ids[b * block_size:(b + 1) * block_size])
        keys.append(parent)
    return keys


@dataclass
class BackendStats:
    batches: int = 0             # batches applied
    replays: int = 0             # replay requests sent
    lost: int = 0                # sequence numbers no replay could supply
    restarts: int = 0            # times the publisher's sequence went back (state cleared)
    orphans: int = 0             # stored blocks whose parent was unknown (no prefix key)
    errors: int = 0              # undecodable messages


@dataclass
class BackendView:
    """One backend's cached blocks, as its events say."""
    name: str
    block_size: int | None = None
    blocks: dict[tuple[int, ExternalHash], bytes | None] = field(default_factory=dict)
    keys: dict[tuple[int, bytes], int] = field(default_factory=dict)     # key → engine blocks
    next_seq: int = 0                          # the sequence number expected next
    seen_ts: OrderedDict[int, float] = field(default_factory=OrderedDict)  # recent seq → ts
    last_ts: float = 0.0                       # ts of the last batch applied
    stats: BackendStats = field(default_factory=BackendStats)

    def clear(self) -> None:
        self.blocks.clear()
        self.keys.clear()
        self.seen_ts.clear()
        self.last_ts = 0.0

    def is_new_publisher(self, seq: int, batch: WireBatch) -> bool:
        """A batch under a seq already applied that is not the one applied: a different
        timestamp under that seq, or (its ts forgotten) one later than anything applied."""
        if seq >= self.next_seq:
            return False
        seen = self.seen_ts.get(seq)
        return batch.ts != seen if seen is not None else batch.ts > self.last_ts

    def apply(self, batch: WireBatch) -> None:
        for event in batch.events:
            if isinstance(event, WireStored):
                self._store(event)
            elif isinstance(event, WireRemoved):
                group = event.group_idx or 0
                for h in event.block_hashes:
                    self._forget(group, h)
            elif isinstance(event, WireCleared):
                self.clear()
        self.stats.batches += 1

    def _store(self, event: WireStored) -> None:
        group, B = event.group_idx or 0, event.block_size
        self.block_size = B
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent = self.blocks.get((group, event.parent_block_hash))
        known_parent = event.parent_block_hash is None or parent is not None
        for i, h in enumerate(event.block_hashes):
            key: bytes | None = None
            tokens = event.token_ids[i * B:(i + 1) * B]
            if known_parent and len(tokens) == B:
                key = parent = prefix_key(parent, tokens)
            else:
                known_parent = False
                self.stats.orphans += 1
            self._forget(group, h)            # a store of a held hash replaces it
            self.blocks[(group, h)] = key
            if key is not None:
                self.keys[(group, key)] = self.keys.get((group, key), 0) + 1

    def _forget(self, group: int, h: ExternalHash) -> None:
        key = self.blocks.pop((group, h), None)
        if key is not None:
            n = self.keys.get((group, key), 0) - 1
            if n > 0:
                self.keys[(group, key)] = n
            else:
                self.keys.pop((group, key), None)


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


class KVEventSubscriber:
    """Follows the KV events of any number of backends; `poll` applies what arrived."""

    def __init__(self, topic: str = "", idle_replay_s: float | None = 2.0) -> None:
        self.topic = topic.encode()
        self.idle_replay_s = idle_replay_s
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
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        (sub.bind if bind else sub.connect)(endpoint)
        replay = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
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
        return set(self._backends[name].view.blocks)

    def cached_prefix_blocks(self, name: str, token_ids: Sequence[int], group: int = 0) -> int:
        """How many leading full blocks of `token_ids` `name` holds in `group`."""
        view = self._backends[name].view
        if not view.block_size:
            return 0
        n = 0
        for key in prefix_keys(token_ids, view.block_size):
            if (group, key) not in view.keys:
                break
            n += 1
        return n

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
                if kind == "monitor":
                    self._on_connection(backend)
                    continue
                read += 1
                backend.last_heard = time.monotonic()
                if kind == "replay":
                    self._on_replay(backend, frames)
                else:
                    self._on_live(backend, frames)
            ready = dict(self._poller.poll(0))
        self._expire_replays()
        return read

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
