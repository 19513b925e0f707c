"""The proxy's state: its backends, their clients, the routers and the background probe of
every backend's /health and /metrics; who may use the proxy (`ProxyAuth`); with
`--kv-events-port` (or KV-event ports in the backends file), the feed of the prefill
servers' KV events (proxy/kv_events.py).

With `--backends-file` the set of backends changes while the proxy runs (`apply`, from the
file's versions: backend_set.py). A backend's life:

    added ──first healthy /health──▶ active ──removed / replaced──▶ draining ──idle──▶ dropped
      (unready: no requests)          (routed)                 (no new requests;  (no probe,
                                                                those in flight   no metrics,
                                                                finish)           client closed)

Idle: nothing in flight on it (`in_flight`) and no request holding it (`holds`: a prefill
whose decode leg has not ended — the decode pulls the KV it holds, and a free notice may
still go to it). A request checks that a backend takes requests just before it sends to it
(`takers`), and counts itself in flight in the same step, so a backend is never dropped
under a request that chose it."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import Response

from kvrelay import http_auth
from kvrelay.proxy import responses, scrape
from kvrelay.proxy.answers import describe, error_response
from kvrelay.proxy.backend_set import BackendsFile, BackendSpec, diff
from kvrelay.proxy.kv_events_feed import EventSource, tcp_endpoint
from kvrelay.proxy.metrics import ProxyMetrics
from kvrelay.proxy.policy import Choice, Router, RoutingSettings, hit_correction
from kvrelay.proxy.prefix import Hasher, PromptKey
from kvrelay.proxy.routing import Backend

if TYPE_CHECKING:
    from kvrelay.proxy.kv_events_feed import KVEventsFeed

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


class _Homes(responses.ResponseHomes):
    """`ResponseHomes` over a changing set: a home that no longer takes requests (drained)
    gives way to the server now listed under its id (a restart elsewhere, whose store may
    have kept the response), else it is forgotten — the follow-up then goes where the
    router sends it, whose store judges the id."""

    def __init__(self, successor: Callable[[Backend], Backend | None]) -> None:
        super().__init__()
        self.successor = successor

    def home(self, response_id: str) -> Backend | None:
        backend = super().home(response_id)
        if backend is None or backend.takes_requests:
            return backend
        new = self.successor(backend)
        if new is None:
            self.forget(response_id)
        else:
            self.remember(response_id, new)
        return new


@dataclass
class ProxyState:
    """Owns the backends (their clients, and their place in the set: `Backend.ready`,
    `draining`, `dropped`, `holds`), the routers' server lists, the probe and the KV-event
    feed. One event loop uses it: no locking."""

    prefill: list[Backend]          # every prefill server held: unready, active and draining
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
    backends_file: BackendsFile | None = None  # --backends-file: the set follows it
    specs: list[BackendSpec] = field(default_factory=list)    # its version in use
    watcher: asyncio.Task | None = None
    opened: bool = False

    @classmethod
    def create(cls, prefill: list[tuple[str, int]], decode: list[tuple[str, int]],
               auth: ProxyAuth | None = None, health_interval_s: float = HEALTH_INTERVAL_S,
               routing: RoutingSettings | None = None,
               busy_retry_s: float = PREFILL_BUSY_RETRY_S,
               backends_file: BackendsFile | None = None) -> ProxyState:
        """The state for these (host, port) servers, or, with `backends_file`, for the servers
        it lists (`prefill` and `decode` are then empty); a file's servers start unready."""
        routing = routing or RoutingSettings()
        specs = [] if backends_file is None else backends_file.current()
        p = [Backend("prefill", h, port) for h, port in prefill]
        d = [Backend("decode", h, port) for h, port in decode]
        for spec in specs:
            (p if spec.role == "prefill" else d).append(_unready(spec))
        metrics = ProxyMetrics(p + d)
        prefill_router = routing.router([b for b in p if b.takes_requests], "prefill")
        feed = None
        events = routing.kv_events
        if events is not None and prefill_router.policy == "cache_aware":
            if backends_file is not None:     # the sources are the file's, as it changes
                events = dataclasses.replace(events, sources=tuple(
                    _source(s) for s in specs if s.kv_events_port is not None))
            if events.sources or backends_file is None:
                feed = events.feed(routing.block_size, metrics.registry)
                prefill_router.events = feed
        state = cls(p, d, metrics, prefill_router,
                    routing.router([b for b in d if b.takes_requests], "decode"),
                    auth or ProxyAuth(), routing, health_interval_s, busy_retry_s,
                    hasher=routing.hasher(feed is not None), kv_events=feed,
                    backends_file=backends_file, specs=specs)
        state.homes = _Homes(state.successor)
        metrics.follow(lambda: state.backends)
        return state

    def router(self, b: Backend) -> Router:
        return self.prefill_router if b.role == "prefill" else self.decode_router

    def role_router(self, role: str) -> Router:
        return self.prefill_router if role == "prefill" else self.decode_router

    def members(self, role: str) -> list[Backend]:
        return self.prefill if role == "prefill" else self.decode

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
        self._drop_when_idle(b)

    def hold(self, b: Backend) -> None:
        """A request prefilled on `b`: its decode will pull the KV `b` holds."""
        b.holds += 1

    def let_go(self, b: Backend) -> None:
        """That request's decode leg ended (and its free notice, if any, was sent)."""
        b.holds -= 1
        self._drop_when_idle(b)

    def takers(self, order: list[Backend], role: str) -> Iterator[Backend]:
        """The backends of `order` that still take requests, each checked when its turn
        comes (one may be drained while the one before it is tried; the caller sends to it,
        and `acquire`s it, before the next await); when none of `order` does any more, the
        role's current choice."""
        taken = False
        for b in order:
            if b.takes_requests:
                taken = True
                yield b
        if not taken:
            for b in self.role_router(role).choose(None).order:
                if b.takes_requests:
                    yield b

    def unserved(self, prefill: Choice | None, decode: Choice,
                 request_id: str) -> Response | None:
        """503 (an OpenAI error) when a leg the request needs has no server to go to: the
        backends file lists none for that role yet, or none is ready, or all are draining."""
        empty = [role for role, choice in (("prefill", prefill), ("decode", decode))
                 if choice is not None and not choice.order]
        if not empty:
            return None
        why = "; ".join(f"no {role} server takes requests ({self._census(role)})"
                        for role in empty)
        return error_response(503, f"{why}: try again later", "ServiceUnavailableError",
                              request_id)

    def _census(self, role: str) -> str:
        members = self.members(role)
        unready = sum(b.state == "unready" for b in members)
        draining = sum(b.state == "draining" for b in members)
        parts = [f"{unready} not ready yet (no healthy /health)"] if unready else []
        parts += [f"{draining} draining"] if draining else []
        return ", ".join(parts) or "none is listed"

    def empty_roles(self) -> list[dict[str, Any]]:
        """/health's entries for the roles the proxy needs and has no server taking
        requests in (a backends file that lists none yet)."""
        roles = ("decode",) if self.routing.disagg.policy == "never" else ("prefill", "decode")
        return [{"role": role, "server": None, "healthy": False,
                 "error": f"no {role} server takes requests ({self._census(role)})"}
                for role in roles if not self.role_router(role).backends]

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
        self.opened = True
        if self.health_interval_s > 0:
            self.prober = asyncio.ensure_future(self._probe_forever())
        else:
            for b in self.backends:
                if not b.ready:             # no probe rounds: one probe admits it
                    self.spawn(self._check(b))
        if self.backends_file is not None:
            self.watcher = asyncio.ensure_future(self._watch_forever())
            logger.info("backends file %s: %d prefill and %d decode servers; re-read when it "
                        "changes", self.backends_file.path, len(self.prefill), len(self.decode))

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
        if b.dropped:                       # drained and forgotten meanwhile
            return
        if reason == TIMED_OUT and b.healthy:
            # a loaded server can miss one probe's deadline and still be serving with its
            # cache intact: only SLOW_PROBES_TO_FAIL timeouts in a row make it unhealthy
            # (a refused connection or a non-200 answer counts at once)
            self.slow_probes[b.name] = self.slow_probes.get(b.name, 0) + 1
            if self.slow_probes[b.name] < SLOW_PROBES_TO_FAIL:
                return
        self.slow_probes.pop(b.name, None)
        if b.ready and b.healthy != (reason is None):
            logger.info("%s server %s is %s", b.role, b.name,
                        "healthy again" if reason is None else f"unhealthy ({reason})")
        if reason is not None:              # down or restarting: its cache is not to be trusted
            self.forget(b, "unhealthy")
        b.healthy = reason is None
        self.metrics.healthy.labels(b.role, b.name).set(int(b.healthy))
        if b.healthy and not b.ready:
            self._admit(b)
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
        if b.dropped:
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
        for task in (self.watcher, self.prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=FREE_TIMEOUT_S)
        for b in self.backends:
            if b.client is not None:
                await b.client.aclose()
        if self.health_client is not None:
            await self.health_client.aclose()
        if self.kv_events is not None:
            self.kv_events.stop()

    # -- a changing set (--backends-file) ------------------------------------------------------
    async def _watch_forever(self) -> None:
        """Every `poll_s` (POLL_S): a new valid version of the backends file is carried out."""
        assert self.backends_file is not None
        while True:
            await asyncio.sleep(self.backends_file.poll_s)
            specs = self.backends_file.poll()
            if specs is not None:
                self.apply(specs)

    def apply(self, specs: list[BackendSpec]) -> None:
        """Make the set the one `specs` lists (backend_set.diff): drain what is removed or
        moved, add what is new, follow changed KV-event ports; then route over the result."""
        change = diff(self.specs, specs)
        self.specs = list(specs)
        for spec in change.drained:
            b = self._listed(spec)
            if b is not None:
                moved = any(s.role == spec.role and s.id == spec.id for s in change.added)
                self._drain(b, "replaced" if moved else "removed")
        for spec in change.added:
            self._add(spec)
        for spec in change.updated:
            b = self._listed(spec)
            if b is not None:
                self._follow_events(b, spec)
        self._route_over_ready()

    def successor(self, b: Backend) -> Backend | None:
        """The server now listed under `b`'s role and id that takes requests, if any."""
        return next((x for x in self.members(b.role)
                     if x.id == b.id and x.takes_requests), None)

    def _listed(self, spec: BackendSpec) -> Backend | None:
        return next((b for b in self.members(spec.role) if not b.draining and b.id == spec.id
                     and b.name == spec.name), None)

    def _drain(self, b: Backend, why: str) -> None:
        b.draining = True
        logger.info("%s server %s (%s) %s: no new requests; draining (%d in flight, %d held "
                    "for a decode)", b.role, b.name, b.id, why, b.in_flight, b.holds)
        self._drop_when_idle(b)

    def _add(self, spec: BackendSpec) -> None:
        """A new server (unready until its /health answers 200), or a draining one at the
        same address taken back."""
        members = self.members(spec.role)
        b = next((x for x in members if x.draining and x.name == spec.name), None)
        if b is not None:
            b.draining, b.id = False, spec.id
            logger.info("%s server %s (%s) listed again: no longer draining", b.role, b.name,
                        b.id)
        else:
            b = _unready(spec)
            members.append(b)
            self.metrics.add(b)
            logger.info("%s server %s (%s) added: requests go to it once its /health answers "
                        "200", b.role, b.name, b.id)
            if self.opened:
                b.client = _backend_client(b)
                self.spawn(self._check(b))
        self._follow_events(b, spec)

    def _admit(self, b: Backend) -> None:
        b.ready = True
        if not b.draining:
            logger.info("%s server %s (%s) answers /health: it takes requests from now on",
                        b.role, b.name, b.id)
            self._route_over_ready()

    def _route_over_ready(self) -> None:
        for role in ("prefill", "decode"):
            self.role_router(role).backends = [b for b in self.members(role) if b.takes_requests]

    def _drop_when_idle(self, b: Backend) -> None:
        """Drop a draining backend once idle. Checked again in a task of its own: whatever
        runs in the same step as the last release (a prefill's `hold`) comes first."""
        if b.draining and not b.dropped and b.idle:
            self.spawn(self._drop(b))

    async def _drop(self, b: Backend) -> None:
        if not (b.draining and not b.dropped and b.idle):
            return                          # held again, or listed again, meanwhile
        b.dropped = True
        self.members(b.role).remove(b)
        self.router(b).drop(b)
        self.slow_probes.pop(b.name, None)
        self.metrics.remove(b)
        if self.kv_events is not None and b.role == "prefill":
            self.kv_events.remove(b.name)
        logger.info("%s server %s (%s) drained: no longer used", b.role, b.name, b.id)
        client, b.client = b.client, None
        if client is not None:
            await client.aclose()

    def _follow_events(self, b: Backend, spec: BackendSpec) -> None:
        """Follow `spec`'s KV events for prefill `b` (anew: its ports may have changed)."""
        if b.role != "prefill":
            return
        if self.kv_events is not None:
            self.kv_events.remove(b.name)
        if spec.kv_events_port is None:
            return
        if self.routing.kv_events is None or self.prefill_router.policy != "cache_aware":
            logger.warning("%s server %s (%s): its kv_events_port is not used: KV events are "
                           "followed under --routing cache_aware only", b.role, b.name, b.id)
            return
        if self.kv_events is None:          # the first server with events: start the feed
            self.kv_events = dataclasses.replace(self.routing.kv_events, sources=()).feed(
                self.routing.block_size, self.metrics.registry)
            self.prefill_router.events = self.kv_events
            self.hasher = self.routing.hasher(token_keys=True)
            if self.opened:
                self.kv_events.start()
        self.kv_events.add(_source(spec))


def _unready(spec: BackendSpec) -> Backend:
    """A backends file's server: no requests until its /health answers 200."""
    return Backend(spec.role, spec.host, spec.port, id=spec.id, ready=False, healthy=False)


def _source(spec: BackendSpec) -> EventSource:
    assert spec.kv_events_port is not None
    replay = spec.kv_events_replay_port
    return EventSource(spec.name, tcp_endpoint(spec.host, spec.kv_events_port),
                       tcp_endpoint(spec.host, replay) if replay else None)


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
