"""The proxy's feed of its servers' KV events into cache-aware routing (`kvrelay proxy
--kv-events-port`): which backends publish where (`KVEventsRouting`, `EventSource`), the
thread that follows them (`KVEventsFeed`, around kv_events.py's `KVEventSubscriber`) and
its metrics (`FeedMetrics`)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.kv_events.config import read_secret
from kvrelay.kv_events.curve import CurveKeys, derive_keys
from kvrelay.proxy.kv_events import KVEventSubscriber
from kvrelay.proxy.kv_view import BackendStats
from kvrelay.proxy.metrics import remove_series
from kvrelay.proxy.prefix import PromptKey

logger = logging.getLogger(__name__)

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
