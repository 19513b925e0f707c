"""A KV-event subscriber: each backend's cached blocks, rebuilt from its `--kv-events-config`
stream (kvrelay's or vLLM's), and the proxy's feed of them into cache-aware routing
(`kvrelay proxy --kv-events-port`, `KVEventsFeed` at the end of this file).

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
from the tokens of its whole prefix (`prefix_key`: the proxy's own chain hash, prefix.py,
from the root `EVENTS_ROOT`, chained from the event's parent), so a router can ask how many
leading blocks of a prompt a backend holds (`cached_prefix_blocks`, or with the keys
already computed, `cached_prefix_keys`) without knowing the engine's hash function (what
llm-d does with vLLM's events).

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
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.kv_events.config import read_secret
from kvrelay.kv_events.curve import CurveKeys, derive_keys, make_client
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
from kvrelay.proxy.metrics import remove_series
from kvrelay.proxy.prefix import EVENTS_ROOT, BlockHash, PromptKey, chain_hash

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0           # a replay without its end marker by then is given up
_SEEN = 64                       # timestamps of the last batches applied, to recognise them


def prefix_key(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """This subscriber's name for a block: the proxy's chain hash (prefix.chain_hash) over its
    parent's key and its tokens as little-endian int64, from `EVENTS_ROOT`. Equal prefixes,
    equal keys, whatever the engine's own hash."""
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return chain_hash(parent if parent is not None else EVENTS_ROOT, packed)


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The keys of the full blocks of `token_ids`."""
    keys: list[BlockHash] = []
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
    last_message: float = 0.0                  # monotonic time of the last message read

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


# -- the proxy's feed ---------------------------------------------------------------------------

STALE_S = 5.0                    # a view with no message for this long is not trusted
FEED_IDLE_REPLAY_S = 1.0         # the feed's idle replays: a live publisher answers each
FEED_POLL_S = 0.1                # how long the feed thread waits for messages at a time


@dataclass(frozen=True)
class EventSource:
    """Where one backend publishes (`name` is the backend's, "host:port" of its HTTP API)."""
    name: str
    endpoint: str
    replay_endpoint: str | None = None


def tcp_endpoint(host: str, port: int) -> str:
    """tcp://HOST:PORT (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class KVEventsRouting:
    """`kvrelay proxy --kv-events-*`: whose events to follow and how (main.py builds it)."""
    sources: tuple[EventSource, ...]
    topic: str = ""
    auth: bool = False                # CURVE keyed from the KV secret (kv_events/curve.py)
    secret_file: str | None = None    # the KV secret when KVRELAY_KV_SECRET is unset

    def feed(self, block_size: int, registry: CollectorRegistry) -> KVEventsFeed:
        """The feed (not started); a ValueError when auth is asked for without a secret."""
        keys = None
        if self.auth:
            keys = derive_keys(read_secret(self.secret_file, "--kv-events-auth",
                                           "--kv-events-secret-file"))
        return KVEventsFeed(self.sources, block_size, self.topic, keys, registry=registry)


class KVEventsFeed:
    """The proxy's view of its servers' caches from their KV events, for the routers.

    Owns a `KVEventSubscriber` and the daemon thread that polls it continually (its sockets
    are made in that thread and used only there). The event loop calls `refine` while it
    routes: for each followed backend whose view is usable — synced, heard from within
    `stale_s` (the idle replays make a live publisher answer every `FEED_IDLE_REPLAY_S`)
    and keyed with the proxy's block size — the router's guessed match is replaced by the
    leading blocks the events say the backend holds. A backend whose stream is silent,
    still joining, or keyed otherwise keeps the guess. A view that lost batches (counted in
    `lost`) stays in use: its errors heal as the server stores blocks again, which the guess
    would never see for traffic that did not pass this proxy.

    Only prompts given as token ids can be matched (`PromptKey.token_keys`): the proxy has
    no tokenizer, and the events name blocks by their token ids.

    The sources may change while it runs (`--backends-file`): `add` and `remove`, from the
    event loop, change `sources` at once and queue the change for the thread, which alone
    touches the subscriber's sockets."""

    def __init__(self, sources: Sequence[EventSource], block_size: int, topic: str = "",
                 keys: CurveKeys | None = None, stale_s: float = STALE_S,
                 idle_replay_s: float = FEED_IDLE_REPLAY_S,
                 registry: CollectorRegistry | None = None) -> None:
        self.sources = list(sources)
        self.block_size = block_size
        self.stale_s = stale_s
        self.subscriber = KVEventSubscriber(topic, idle_replay_s, keys)
        self.metrics = FeedMetrics(self, registry or CollectorRegistry())
        self._initial = list(sources)
        self._changes: queue.SimpleQueue[tuple[str, EventSource]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-feed", daemon=True)

    def start(self) -> None:
        """Starts the thread; raises what adding the backends raised (a bad endpoint)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        logger.info("KV events: cache_aware routing follows %s%s (token-id prompts; a silent "
                    "stream falls back to the proxy's own guess)",
                    ", ".join(f"{x.name} at {x.endpoint}" for x in self.sources) or "no server yet",
                    ", CURVE keyed from the KV secret" if self.subscriber.keys else "")

    def add(self, source: EventSource) -> None:
        """Follow one more backend's events (its view joins in the feed thread)."""
        self.sources.append(source)
        self.metrics.add(source.name)
        self._changes.put(("add", source))
        logger.info("KV events: following %s at %s", source.name, source.endpoint)

    def remove(self, name: str) -> None:
        """Stop following `name`: it is no longer consulted, its sockets close in the thread."""
        for source in [s for s in self.sources if s.name == name]:
            self.sources.remove(source)
            self.metrics.remove(name)
            self._changes.put(("remove", source))

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            for s in self._initial:
                self.subscriber.add_backend(s.name, s.endpoint, s.replay_endpoint)
        except Exception as e:  # noqa: BLE001 -- handed to start()'s caller
            self._error = e
            self.subscriber.close()
            return
        finally:
            self._ready.set()
        try:
            while not self._stop.is_set():
                self._apply_changes()
                if len(self.subscriber):
                    self.subscriber.poll(FEED_POLL_S)
                else:                              # nothing to poll: poll() would not wait
                    self._stop.wait(FEED_POLL_S)
        except Exception:  # noqa: BLE001 -- the routers fall back to their guess
            logger.exception("KV events: the feed stopped; routing uses the proxy's own guess")
        finally:
            self.subscriber.close()

    def _apply_changes(self) -> None:
        """The sources added and removed since the last poll, in order (the feed thread)."""
        while True:
            try:
                change, source = self._changes.get_nowait()
            except queue.Empty:
                return
            try:
                if change == "add":
                    self.subscriber.add_backend(source.name, source.endpoint,
                                                source.replay_endpoint)
                else:
                    self.subscriber.remove_backend(source.name)
            except Exception as e:  # noqa: BLE001 -- one bad source must not stop the others
                logger.warning("KV events: could not %s %s at %s: %s; its routing uses the "
                               "proxy's own guess", "follow" if change == "add" else "drop",
                               source.name, source.endpoint, e)

    # -- queries (the event loop) -------------------------------------------------------------
    def usable(self, name: str, now: float | None = None) -> bool:
        """`name`'s events are followed, current and keyed with the proxy's block size (a
        backend the closing thread already dropped is not)."""
        if self._stop.is_set() or not self._thread.is_alive():
            return False
        try:
            view = self.subscriber.view(name)
            return (view.block_size in (None, self.block_size)
                    and self.subscriber.synced(name, self.stale_s, now))
        except KeyError:
            return False

    def refine(self, key: PromptKey, matched: dict[str, int]) -> dict[str, int]:
        """`matched` (backend → leading blocks held, the router's guess) with each usable
        followed backend's count from its events; counted per source in `lookups`."""
        if key.token_keys is None:
            return matched
        out = dict(matched)
        now = time.monotonic()
        for s in self.sources:
            if s.name not in out:
                continue
            source = "events" if self.usable(s.name, now) else "guess"
            if source == "events":
                try:
                    out[s.name] = self.subscriber.cached_prefix_keys(s.name, key.token_keys)
                except KeyError:                  # dropped by the closing thread meanwhile
                    source = "guess"
            self.metrics.lookups.labels(s.name, source).inc()
            self.metrics.matched.labels(s.name, source).inc(out[s.name])
        return out

    def stats(self, name: str) -> BackendStats:
        return self.subscriber.view(name).stats


class FeedMetrics(Collector):
    """`kvrelay_proxy:kv_events_*`: which source each routed prompt's match came from, the
    blocks matched, whether each stream is usable, and the subscriber's counters."""

    def __init__(self, feed: KVEventsFeed, registry: CollectorRegistry) -> None:
        self.feed = feed
        self.lookups = Counter("kvrelay_proxy:kv_events_lookups",
                               "Token-id prompts matched against a followed backend, by where "
                               "the match came from (events: its KV events; guess: the "
                               "proxy's own table, its stream being silent or joining).",
                               ["backend", "source"], registry=registry)
        self.matched = Counter("kvrelay_proxy:kv_events_matched_blocks",
                               "Leading prompt blocks a followed backend was found to hold, "
                               "by source.", ["backend", "source"], registry=registry)
        for s in feed.sources:
            self.add(s.name)
        registry.register(self)

    def add(self, name: str) -> None:
        for source in ("events", "guess"):
            self.lookups.labels(name, source)
            self.matched.labels(name, source)

    def remove(self, name: str) -> None:
        for counter in (self.lookups, self.matched):
            remove_series(counter, ("backend", "source"), (name,))

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvrelay_proxy:kv_events_stream_up",
                               "1 when the backend's KV-event view is used for routing.",
                               labels=["backend"])
        families = {field: CounterMetricFamily(f"kvrelay_proxy:kv_events_{field}",
                                               f"KV-event subscriber: {doc}.", labels=["backend"])
                    for field, doc in (("batches", "batches applied"),
                                       ("replays", "replay requests sent"),
                                       ("lost", "batches no replay could supply"),
                                       ("restarts", "publisher restarts seen (view rebuilt)"),
                                       ("errors", "undecodable messages"))}
        now = time.monotonic()
        for s in self.feed.sources:
            up.add_metric([s.name], float(self.feed.usable(s.name, now)))
            try:
                stats = self.feed.stats(s.name)
            except KeyError:                      # not joined yet, or closing
                continue
            for name, family in families.items():
                family.add_metric([s.name], float(getattr(stats, name)))
        yield up
        yield from families.values()
