"""The proxy's state: its backends, their clients, the routers and the background probe of
every backend's /health and /metrics; who may use the proxy (`ProxyAuth`); with
`--kv-events-port`, the feed of the prefill servers' KV events (proxy/kv_events.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from kvrelay import http_auth
from kvrelay.proxy import responses, scrape
from kvrelay.proxy.answers import describe
from kvrelay.proxy.metrics import ProxyMetrics
from kvrelay.proxy.policy import Router, RoutingSettings, hit_correction
from kvrelay.proxy.prefix import Hasher, PromptKey
from kvrelay.proxy.routing import Backend

if TYPE_CHECKING:
    from kvrelay.proxy.kv_events import KVEventsFeed

logger = logging.getLogger("kvrelay.proxy")

CONNECT_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 2.0
SLOW_PROBES_TO_FAIL = 2          # timed-out probes in a row before a backend counts as down
TIMED_OUT = f"no answer within {HEALTH_TIMEOUT_S:g}s"
FREE_TIMEOUT_S = 5.0
PREFILL_BUSY_RETRY_S = 10.0      # how long one request may wait for a busy prefill (the flag's)
MAX_CONNECTIONS = 1024           # per backend
MAX_KEEPALIVE = 256
# Idle backend connections are dropped after this long, well before uvicorn (kvrelay serve,
# vLLM) closes them at 5 s: the proxy never writes a request into a connection the server is
# closing at that instant (no answer then looks like a crash: 502, not re-sent). One the
# server closed earlier, httpx finds closed before writing and replaces.
KEEPALIVE_EXPIRY_S = 2.0
HEALTH_INTERVAL_S = 2.0          # background /health probe of every backend


@dataclass(frozen=True)
class ProxyAuth:
    """Who may use the proxy, and what it tells the backends.

    `api_key`: the Bearer key clients must present on /v1/ (None: no check). `backend_key`:
    the proxy's own key for the backends ($OPENAI_API_KEY), sent only for authenticated
    clients, i.e. only when `api_key` is set."""

    api_key: str | None = None
    backend_key: str | None = None

    def admits(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        return http_auth.bearer_matches(authorization, [self.api_key])

    def backend_authorization(self, client_authorization: str | None) -> str | None:
        if self.api_key is not None and self.backend_key:
            return f"Bearer {self.backend_key}"
        return client_authorization


@dataclass
class ProxyState:
    prefill: list[Backend]
    decode: list[Backend]
    metrics: ProxyMetrics
    prefill_router: Router
    decode_router: Router
    auth: ProxyAuth = field(default_factory=ProxyAuth)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    health_interval_s: float = HEALTH_INTERVAL_S
    busy_retry_s: float = PREFILL_BUSY_RETRY_S
    health_client: httpx.AsyncClient | None = None
    prober: asyncio.Task | None = None
    slow_probes: dict[str, int] = field(default_factory=dict)  # backend → probes timed out in a row
    tasks: set[asyncio.Task] = field(default_factory=set)

    hasher: Hasher = field(default_factory=Hasher)
    homes: responses.ResponseHomes = field(default_factory=responses.ResponseHomes)
    kv_events: KVEventsFeed | None = None      # the prefills' KV events (started by `open`)

    @classmethod
    def create(cls, prefill: list[tuple[str, int]], decode: list[tuple[str, int]],
               auth: ProxyAuth | None = None, health_interval_s: float = HEALTH_INTERVAL_S,
               routing: RoutingSettings | None = None,
               busy_retry_s: float = PREFILL_BUSY_RETRY_S) -> ProxyState:
        routing = routing or RoutingSettings()
        p = [Backend("prefill", h, port) for h, port in prefill]
        d = [Backend("decode", h, port) for h, port in decode]
        metrics = ProxyMetrics(p + d)
        prefill_router = routing.router(p, "prefill")
        feed = None
        if routing.kv_events is not None and prefill_router.policy == "cache_aware":
            feed = routing.kv_events.feed(routing.block_size, metrics.registry)
            prefill_router.events = feed
        return cls(p, d, metrics, prefill_router, routing.router(d, "decode"),
                   auth or ProxyAuth(), routing, health_interval_s, busy_retry_s,
                   hasher=routing.hasher(), kv_events=feed)

    def router(self, b: Backend) -> Router:
        return self.prefill_router if b.role == "prefill" else self.decode_router

    def record(self, key: PromptKey | None, b: Backend) -> None:
        """`b` now holds the prompt's blocks (it prefilled them, or received them)."""
        router = self.router(b)
        router.record(key, b)
        self.metrics.table_blocks.labels(b.role, b.name).set(router.table.blocks(b.name))

    def forget(self, b: Backend, reason: str) -> None:
        """What `b` cached is gone (it is down, unreachable, or restarted)."""
        dropped = self.router(b).forget(b)
        if dropped:
            self.metrics.forgotten.labels(b.role, b.name, reason).inc()
            self.metrics.table_blocks.labels(b.role, b.name).set(0)
            logger.info("%s server %s: forgot the %d prompt blocks it held (%s)", b.role, b.name,
                        dropped, reason)

    @property
    def backends(self) -> list[Backend]:
        return self.prefill + self.decode

    def acquire(self, b: Backend) -> None:
        b.in_flight += 1
        self.metrics.in_flight.labels(b.role, b.name).inc()

    def release(self, b: Backend) -> None:
        b.in_flight -= 1
        self.metrics.in_flight.labels(b.role, b.name).dec()

    def failed(self, b: Backend, reason: str) -> None:
        b.mark_failed()
        self.metrics.failures.labels(b.role, b.name, reason).inc()
        if reason == "connect":            # nothing listens: it died or is restarting
            self.forget(b, "connect")

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def open(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        for b in self.backends:
            b.client = _backend_client(b)
        self.health_client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, trust_env=False)
        if self.health_interval_s > 0:
            self.prober = asyncio.ensure_future(self._probe_forever())

    async def _probe_forever(self) -> None:
        """Every backend's /health, all the time: a server that is down (or restarting, or
        still loading) goes to the end of the order until it answers 200 again. Each
        healthy backend's /metrics is read right after its own probe, so the scrapes never
        delay a probe round; rounds start every `health_interval_s`."""
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self._check(b) for b in self.backends))
            await asyncio.sleep(max(0.0, self.health_interval_s - (time.monotonic() - started)))

    async def _check(self, b: Backend) -> None:
        reason = await probe(self, b)
        if reason == TIMED_OUT and b.healthy:
            # a loaded server can miss one probe's deadline and still be serving with its
            # cache intact: only SLOW_PROBES_TO_FAIL timeouts in a row make it unhealthy
            # (a refused connection or a non-200 answer counts at once)
            self.slow_probes[b.name] = self.slow_probes.get(b.name, 0) + 1
            if self.slow_probes[b.name] < SLOW_PROBES_TO_FAIL:
                return
        self.slow_probes.pop(b.name, None)
        if b.healthy != (reason is None):
            logger.info("%s server %s is %s", b.role, b.name,
                        "healthy again" if reason is None else f"unhealthy ({reason})")
        if reason is not None:              # down or restarting: its cache is not to be trusted
            self.forget(b, "unhealthy")
        b.healthy = reason is None
        self.metrics.healthy.labels(b.role, b.name).set(int(b.healthy))
        if b.healthy:
            await self._scrape(b)

    async def _scrape(self, b: Backend) -> None:
        """The backend's load, KV usage and capacity, and prefix-cache counters from its
        /metrics (vLLM's names); a server without them keeps the proxy's own counts."""
        assert self.health_client is not None
        try:
            resp = await self.health_client.get(f"{b.url}/metrics")
            if resp.status_code != 200:
                return
            report = scrape.parse(resp.text)
        except (httpx.HTTPError, ValueError) as e:
            logger.debug("%s server %s: /metrics unreadable: %s", b.role, b.name, e)
            return
        if scrape.apply(b, report):
            self.forget(b, "restarted")
            b.window_start = None
        self._correct(b)
        capacity = report.values.get("kv_blocks_total")
        if capacity:
            self.router(b).table.set_capacity(b.name, int(capacity))

    def _correct(self, b: Backend) -> None:
        """Fewer prefix-cache hits reported than the router expected: the server evicted
        some of what the table says it holds; drop that share, oldest first."""
        share = hit_correction(b)
        table = self.router(b).table
        if share is None or not table.blocks(b.name):
            return
        dropped = table.evict(b.name, math.ceil(table.blocks(b.name) * share))
        self.metrics.forgotten.labels(b.role, b.name, "missed_hits").inc()
        self.metrics.table_blocks.labels(b.role, b.name).set(table.blocks(b.name))
        logger.info("%s server %s: reported fewer prefix-cache hits than expected; dropped its "
                    "%d oldest prompt blocks (%.0f%%)", b.role, b.name, dropped, share * 100)

    async def close(self) -> None:
        if self.prober is not None:
            self.prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.prober
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=FREE_TIMEOUT_S)
        for b in self.backends:
            if b.client is not None:
                await b.client.aclose()
        if self.health_client is not None:
            await self.health_client.aclose()
        if self.kv_events is not None:
            self.kv_events.stop()


def _backend_client(b: Backend) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=b.url, trust_env=False,    # never route backend traffic through an HTTP(S)_PROXY
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=WRITE_TIMEOUT_S,
                              pool=None),
        limits=httpx.Limits(max_connections=MAX_CONNECTIONS,
                            max_keepalive_connections=MAX_KEEPALIVE,
                            keepalive_expiry=KEEPALIVE_EXPIRY_S),
        headers={"Accept-Encoding": "identity"})


async def probe(state: ProxyState, backend: Backend) -> str | None:
    """None when `GET /health` answers 200 within HEALTH_TIMEOUT_S, else why not."""
    assert state.health_client is not None
    try:
        resp = await state.health_client.get(f"{backend.url}/health")
    except httpx.TimeoutException:
        return TIMED_OUT
    except httpx.TransportError as e:
        return describe(e)
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"
