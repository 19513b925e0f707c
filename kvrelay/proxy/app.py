"""The disaggregated prefill/decode proxy (`kvrelay proxy`): FastAPI app.

One completion or chat request, vLLM's wire format:

```
client ──POST /v1/completions──▶ proxy        X-Request-Id: the client's, else a new uuid
                                   │
   1. prefill (--routing: longest cached prefix by default; only a server the proxy cannot
      connect to is skipped; --disagg-policy auto may skip this leg: straight to 2.)
                                   ├──▶ prefill  body: max_tokens 1, stream false, no
                                   │             stream_options / min_tokens /
                                   │             min_completion_tokens, kv_transfer_params
                                   │             {do_remote_decode: true, ...null}
                                   │◀── 200 {..., kv_transfer_params {do_remote_prefill: true,
                                   │        remote_engine_id, remote_block_ids, remote_host,
                                   │        remote_port, remote_request_id, tp_size}}
                                   │    4xx/5xx → returned to the client as is (no decode, and
                                   │    never re-sent elsewhere: the request reached a server)
                                   │    except 503 + Retry-After (busy: "KV hold refused", it
                                   │    kept nothing) → the next server, then rounds with backoff
                                   │    for at most --prefill-busy-retry seconds
                                   │    took the request, closed without a status line
                                   │    (crashed?) → 502, never re-sent elsewhere
                                   │    no server could be connected to → 503
   2. decode (--routing, by load and KV usage; cannot connect → the next one; took the
      request and closed without answering → 502 and a free notice, never re-sent)
                                   ├──▶ decode   the ORIGINAL body + the prefill's
                                   │             kv_transfer_params (remote_host 0.0.0.0/empty
                                   │             → the prefill host used)
client ◀── SSE chunks / JSON ──────┘◀── decode pulls the KV over NIXL, streams; relayed unbuffered
```

Failures after a successful prefill (decode unreachable or closing without an answer,
decode error status, stream cut, client gone) send a best-effort `POST
/v1/kv_transfer/free {remote_request_id, remote_engine_id, remote_capability}` to that
prefill server so it frees the blocks it holds for decode (a kvrelay prefill frees them
only with the capability it issued).
A client that disconnects cancels the backend request in flight (the backend sees its
connection close and aborts); it is counted and logged as status 499.

Clients: with an API key (`--api-key` or $KVRELAY_API_KEY / $VLLM_API_KEY) every `/v1/` request
must present `Authorization: Bearer KEY` (else 401); the backends then get $OPENAI_API_KEY when
set, else the client's header. Without a key the client's own Authorization is forwarded and
$OPENAI_API_KEY is never sent: the proxy does not lend its credentials to clients it has not
authenticated. A background probe of every backend's `/health` (every `health_interval_s`)
puts servers that are down or not ready at the end of the order until they answer 200 again;
the same loop reads their `/metrics` (load, KV usage and capacity, prefix-cache counters).
Server choice and whether to disaggregate at all are `policy.py`'s (`_route`), over the prefix
table of `prefix.py`. `POST /v1/responses` takes the same legs (its prefill body is
`responses.py`'s); a `previous_response_id` follow-up, GET and DELETE go to the decode
server that stored the response (`responses.ResponseHomes`, learned from relayed answers).
Every error the proxy itself returns is an OpenAI error body.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvrelay import http_auth, http_body
from kvrelay.proxy import responses, scrape
from kvrelay.proxy.body import INLINE_PARSE_BYTES, ClientBody, Payload, parse_body, read_body
from kvrelay.proxy.policy import Choice, Router, RoutingSettings, hit_correction
from kvrelay.proxy.prefix import Hasher, PromptKey
from kvrelay.proxy.routing import Backend, free_notice, prefill_edit, routable_kv_params

logger = logging.getLogger("kvrelay.proxy")
T = TypeVar("T")

CONNECT_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 2.0
SLOW_PROBES_TO_FAIL = 2          # timed-out probes in a row before a backend counts as down
_TIMED_OUT = f"no answer within {HEALTH_TIMEOUT_S:g}s"
FREE_TIMEOUT_S = 5.0
PREFILL_BUSY_RETRY_S = 10.0      # how long one request may wait for a busy prefill (the flag's)
BUSY_BACKOFF_S = 0.1             # first wait when every prefill server is busy; doubles
MAX_BUSY_ROUNDS = 12             # rounds over the prefill servers, whatever the time left
MAX_CONNECTIONS = 1024           # per backend
MAX_KEEPALIVE = 256
# Idle backend connections are dropped after this long, well before uvicorn (kvrelay serve,
# vLLM) closes them at 5 s: the proxy never writes a request into a connection the server is
# closing at that instant (no answer then looks like a crash: 502, not re-sent). One the
# server closed earlier, httpx finds closed before writing and replaces.
KEEPALIVE_EXPIRY_S = 2.0
HEALTH_INTERVAL_S = 2.0          # background /health probe of every backend
FREE_PATH = "/v1/kv_transfer/free"
FREE_RESULTS = ("sent", "not_found", "rejected", "error")
CLIENT_CLOSED = 499              # nginx's "client closed request", for metrics and logs
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0)


class ClientGone(Exception):
    """The client closed its connection while the proxy was waiting on a backend."""


# ---------------------------------------------------------------------------- metrics

class ProxyMetrics:
    """`kvrelay_proxy:*` metrics in a registry of this app's own."""

    def __init__(self, backends: list[Backend]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvrelay_proxy:requests",
                                "Client requests by endpoint and status returned.",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("kvrelay_proxy:backend_in_flight",
                               "Requests in flight per backend server.",
                               ["role", "backend"], registry=r)
        self.prefill_latency = Histogram("kvrelay_proxy:prefill_latency_seconds",
                                         "Prefill leg: request sent to response read.", ["backend"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.decode_latency = Histogram("kvrelay_proxy:decode_latency_seconds",
                                        "Decode leg: request sent to last byte relayed.",
                                        ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.failures = Counter("kvrelay_proxy:backend_failures",
                                "Backend attempts that failed, by reason.",
                                ["role", "backend", "reason"], registry=r)
        self.busy_retries = Counter("kvrelay_proxy:prefill_busy_retries",
                                    "Prefill answers 503 with Retry-After (busy: KV hold "
                                    "refused) that the proxy retried, per prefill server.",
                                    ["backend"], registry=r)
        self.healthy = Gauge("kvrelay_proxy:backend_healthy",
                             "1 when the backend's last background /health probe answered 200.",
                             ["role", "backend"], registry=r)
        self.free_notices = Counter("kvrelay_proxy:kv_free_notices",
                                    "Free notices sent to prefill servers after a failed decode.",
                                    ["result"], registry=r)
        self.decisions = Counter("kvrelay_proxy:routing_decisions",
                                 "Routing decisions: role prefill/decode (cache_hit, "
                                 "load_override, least_loaded, round_robin) and role disagg "
                                 "(prefill_then_decode, direct_to_decode).",
                                 ["role", "decision"], registry=r)
        self.table_blocks = Gauge("kvrelay_proxy:prefix_table_blocks",
                                  "Prompt blocks the router believes a backend holds.",
                                  ["role", "backend"], registry=r)
        self.forgotten = Counter("kvrelay_proxy:prefix_table_forgotten",
                                 "Times a backend's prefix-table entries were dropped, by reason "
                                 "(unhealthy, connect, restarted, missed_hits).",
                                 ["role", "backend", "reason"], registry=r)
        for result in FREE_RESULTS:
            self.free_notices.labels(result)
        for decision in ("prefill_then_decode", "direct_to_decode"):
            self.decisions.labels("disagg", decision)
        for b in backends:
            self.in_flight.labels(b.role, b.name).set(0)
            self.healthy.labels(b.role, b.name).set(1)
            (self.prefill_latency if b.role == "prefill" else self.decode_latency).labels(b.name)
            if b.role == "prefill":
                self.busy_retries.labels(b.name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------------------- state

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

    @classmethod
    def create(cls, prefill: list[tuple[str, int]], decode: list[tuple[str, int]],
               auth: ProxyAuth | None = None, health_interval_s: float = HEALTH_INTERVAL_S,
               routing: RoutingSettings | None = None,
               busy_retry_s: float = PREFILL_BUSY_RETRY_S) -> ProxyState:
        routing = routing or RoutingSettings()
        p = [Backend("prefill", h, port) for h, port in prefill]
        d = [Backend("decode", h, port) for h, port in decode]
        return cls(p, d, ProxyMetrics(p + d), routing.router(p, "prefill"),
                   routing.router(d, "decode"),
                   auth or ProxyAuth(), routing, health_interval_s, busy_retry_s,
                   hasher=routing.hasher())

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
        reason = await _probe(self, b)
        if reason == _TIMED_OUT and b.healthy:
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


def _backend_client(b: Backend) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=b.url, trust_env=False,    # never route backend traffic through an HTTP(S)_PROXY
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=WRITE_TIMEOUT_S,
                              pool=None),
        limits=httpx.Limits(max_connections=MAX_CONNECTIONS,
                            max_keepalive_connections=MAX_KEEPALIVE,
                            keepalive_expiry=KEEPALIVE_EXPIRY_S),
        headers={"Accept-Encoding": "identity"})


# ---------------------------------------------------------------------------- helpers

def _error(status: int, message: str, type_: str, request_id: str | None = None,
           param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=_id_header(request_id))


def _id_header(request_id: str | None) -> dict[str, str]:
    return {"X-Request-Id": request_id} if request_id else {}


def _copy_response(resp: httpx.Response, content: bytes, request_id: str) -> Response:
    """A backend's status, body and content type, as they came; its Retry-After too (a
    prefill's 429 over the hold rate, 503 with a full hold share)."""
    headers = _id_header(request_id)
    if "retry-after" in resp.headers:
        headers["Retry-After"] = resp.headers["retry-after"]
    return Response(content, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))


def _describe(e: Exception) -> str:
    if isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
        return "connection timed out"
    if isinstance(e, httpx.ConnectError):
        cause = _root_os_error(e)
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect: {cause.strerror or cause}" if cause else f"cannot connect: {e}"
    if str(e):
        return f"{type(e).__name__}: {e}"
    cause = _root_os_error(e)                # e.g. ReadError: connection reset by peer
    if cause is None:
        return type(e).__name__
    return f"{type(e).__name__}: {(cause.strerror or str(cause)).lower()}"


def _root_os_error(e: BaseException) -> OSError | None:
    """httpx says "All connection attempts failed"; the OSError underneath says why."""
    seen: set[int] = set()
    found: OSError | None = None
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            found = cur                      # the deepest one carries the errno
        cur = cur.__cause__ or cur.__context__
    return found


def _is_connect_error(e: Exception) -> bool:
    """No connection was made (refused, timed out, DNS, TLS): the request never left the
    proxy, so another server may have it. Any other transport error came after the request
    was written: the server had it."""
    return isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)


def _no_answer(state: ProxyState, backend: Backend, e: httpx.TransportError,
               request_id: str) -> Response:
    """`backend` took the request, then closed, reset or timed out without a status line.
    It may have acted on it, or the request may be what broke it (a crash): no other server
    gets it, so one request cannot take down every server in turn. The client gets 502."""
    state.failed(backend, "transport")
    logger.warning("request %s: %s server %s took the request and closed the connection "
                   "without answering: %s (not sent to another server)", request_id,
                   backend.role, backend.name, _describe(e))
    return _error(502, f"{backend.role} server {backend.name} closed the connection without "
                  f"answering ({_describe(e)}); the request was not sent to another server",
                  "BadGatewayError", request_id)


def _backend_headers(state: ProxyState, request: Request, request_id: str) -> dict[str, str]:
    """X-Request-Id for both legs, and the Authorization `ProxyAuth` chooses."""
    headers = {"X-Request-Id": request_id}
    auth = state.auth.backend_authorization(request.headers.get("authorization"))
    if auth:
        headers["Authorization"] = auth
    return headers


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which closes its backend connection) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


async def _read_body(request: Request, request_id: str) -> ClientBody | Response:
    """The client's body, checked and split into its fields (`parse_body`; a body over
    INLINE_PARSE_BYTES on a worker thread: a 30 MB body takes about a second, and /health
    and other clients' streams go on meanwhile)."""
    try:
        raw = await read_body(request.stream(), request.headers.get("content-length"))
        if len(raw) <= INLINE_PARSE_BYTES:
            return parse_body(raw)
        return await asyncio.to_thread(parse_body, raw)
    except http_body.BodyError as e:
        type_ = "RequestTooLarge" if e.status == 413 else "BadRequestError"
        return _error(e.status, e.message, type_, request_id, e.param)


def _json_request(client: httpx.AsyncClient, path: str, payload: Payload,
                  headers: dict[str, str]) -> httpx.Request:
    """A POST of `payload` (the client's bytes with the leg's fields spliced in)."""
    return client.build_request("POST", path, content=payload.content(),
                                headers={**headers, "Content-Type": "application/json",
                                         "Content-Length": str(payload.length)})


# ---------------------------------------------------------------------------- prefill leg

@dataclass
class Prefilled:
    backend: Backend
    kv_params: dict[str, Any]       # as the prefill returned them, remote_host made routable
    seconds: float = 0.0


class AnswerBroken(Exception):
    """A backend sent its status line, then the connection broke: it answered, so the
    request is not sent elsewhere."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


async def _prefill(state: ProxyState, path: str, client_body: ClientBody,
                   headers: dict[str, str], request_id: str,
                   order: list[Backend]) -> Prefilled | Response:
    """Send the prefill request to the servers of `order`, first one first. Only a server the
    proxy could not connect to (`_is_connect_error`: the request never left) is replaced by
    the next one: a server that took the request — answered it with any status, or closed
    the connection without answering (`_no_answer`: 502) — may have acted on it, and a
    request that makes servers fail must not go round all of them. One exception: a busy
    answer (`_busy`: it kept nothing, and nothing of it reaches the client) goes to the
    next server, and when every server is busy the proxy waits (backoff) and goes round
    again, for at most `state.busy_retry_s` seconds and MAX_BUSY_ROUNDS rounds; then the
    client gets the last busy answer as is."""
    edit = (responses.prefill_edit if path == responses.PATH else prefill_edit)(client_body.fields)
    payload = client_body.payload(*edit)
    failures: list[str] = []
    deadline = time.monotonic() + state.busy_retry_s
    order = list(order)
    for rounds in range(1, MAX_BUSY_ROUNDS + 1):
        busy: tuple[Backend, httpx.Response] | None = None
        for backend in list(order):
            try:
                resp = await _post_prefill(state, backend, path, payload, headers)
            except httpx.TransportError as e:
                if not _is_connect_error(e):
                    return _no_answer(state, backend, e, request_id)
                state.failed(backend, "connect")
                logger.warning("request %s: prefill server %s could not be reached: %s",
                               request_id, backend.name, _describe(e))
                failures.append(f"{backend.name} ({_describe(e)})")
                order.remove(backend)                 # not tried again in a later round
                continue
            except AnswerBroken as e:
                state.failed(backend, "transport")
                logger.warning("request %s: prefill server %s broke off its answer: %s",
                               request_id, backend.name, _describe(e.error))
                return _error(502, f"prefill server {backend.name} broke off its answer: "
                              f"{_describe(e.error)}", "BadGatewayError", request_id)
            if _busy(resp) and time.monotonic() < deadline and rounds < MAX_BUSY_ROUNDS:
                state.metrics.busy_retries.labels(backend.name).inc()
                logger.info("request %s: prefill server %s is busy (%d, Retry-After %s): "
                            "trying again elsewhere or later", request_id, backend.name,
                            resp.status_code, resp.headers.get("retry-after"))
                busy = (backend, resp)
                continue
            return _prefill_answer(state, backend, resp, request_id)
        if busy is None:
            break
        wait = min(BUSY_BACKOFF_S * 2 ** (rounds - 1), _retry_after(busy[1]),
                   deadline - time.monotonic())
        if wait <= 0:
            return _prefill_answer(state, *busy, request_id)
        await asyncio.sleep(wait)
    return _error(503, "no prefill server could take the request: " + "; ".join(failures),
                  "ServiceUnavailableError", request_id)


def _busy(resp: httpx.Response) -> bool:
    """A prefill that is busy, not broken: 503 with Retry-After (a kvrelay prefill whose KV
    hold for the decode was refused; it freed the blocks and holds nothing)."""
    return resp.status_code == 503 and "retry-after" in resp.headers


def _retry_after(resp: httpx.Response) -> float:
    try:
        return max(float(resp.headers.get("retry-after", "1")), 0.0)
    except ValueError:                   # an HTTP date: wait the longest backoff step
        return 1.0


def _prefill_answer(state: ProxyState, backend: Backend, resp: httpx.Response,
                    request_id: str) -> Prefilled | Response:
    """The prefill's answer taken as final: count a 5xx, then the result for the client."""
    if resp.status_code >= 500:
        reason = f"http_{resp.status_code}"
        state.metrics.failures.labels(backend.role, backend.name, reason).inc()
        logger.warning("request %s: prefill server %s answered %d (returned as is, not "
                       "retried)", request_id, backend.name, resp.status_code)
    else:
        backend.mark_ok()
    return _prefill_result(backend, resp, request_id, resp.elapsed.total_seconds())


async def _post_prefill(state: ProxyState, backend: Backend, path: str,
                        payload: Payload, headers: dict[str, str]) -> httpx.Response:
    """The prefill's whole answer. httpx.TransportError: no response came (sent elsewhere
    only when `_is_connect_error`); AnswerBroken: the response started, then broke."""
    assert backend.client is not None
    state.acquire(backend)
    t0 = time.monotonic()
    try:
        request = _json_request(backend.client, path, payload, headers)
        resp = await backend.client.send(request, stream=True)
        try:
            await resp.aread()
        except httpx.TransportError as e:
            raise AnswerBroken(e) from e
        finally:
            await resp.aclose()
    finally:
        state.release(backend)
    state.metrics.prefill_latency.labels(backend.name).observe(time.monotonic() - t0)
    return resp


def _prefill_result(backend: Backend, resp: httpx.Response, request_id: str,
                    seconds: float) -> Prefilled | Response:
    if not resp.is_success:
        return _copy_response(resp, resp.content, request_id)       # a client mistake: as is
    try:
        kv_params = resp.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        kv_params = None
    if not isinstance(kv_params, dict):
        return _error(502,
                      f"prefill server {backend.name} answered without kv_transfer_params; is it "
                      "started with --kv-transfer-config (kv_role kv_producer or kv_both)?",
                      "BadGatewayError", request_id)
    return Prefilled(backend, routable_kv_params(kv_params, backend.host), seconds)


# ---------------------------------------------------------------------------- decode leg

@dataclass
class DecodeLeg:
    backend: Backend
    response: httpx.Response        # headers read, body not yet
    started: float


async def _open_decode(state: ProxyState, path: str, payload: Payload,
                       headers: dict[str, str],
                       request_id: str, order: list[Backend]) -> DecodeLeg | Response:
    """Send the decode request to the servers of `order`, first one first; as for prefill,
    only a server the proxy could not connect to is replaced by the next one (one that took
    the request and closed without answering: 502)."""
    failures: list[str] = []
    for backend in order:
        assert backend.client is not None
        state.acquire(backend)
        t0 = time.monotonic()
        try:
            request = _json_request(backend.client, path, payload, headers)
            resp = await backend.client.send(request, stream=True)
        except httpx.TransportError as e:         # no response started
            state.release(backend)
            if not _is_connect_error(e):              # it had the request: not sent elsewhere
                return _no_answer(state, backend, e, request_id)
            state.failed(backend, "connect")
            logger.warning("request %s: decode server %s could not be reached: %s", request_id,
                           backend.name, _describe(e))
            failures.append(f"{backend.name} ({_describe(e)})")
            continue
        except BaseException:
            state.release(backend)
            raise
        backend.mark_ok()
        return DecodeLeg(backend, resp, t0)
    return _error(503, "no decode server could take the request: " + "; ".join(failures),
                  "ServiceUnavailableError", request_id)


class RelayStream(Response):
    """Relays a decode server's streamed body chunk by chunk (no buffering). Watches the client
    connection meanwhile: a disconnect closes the decode stream at once, so decode aborts."""

    def __init__(self, leg: DecodeLeg, request_id: str, on_end: Callable[[str], None],
                 sniffer: responses.StreamSniffer | None = None) -> None:
        self.leg, self.on_end, self.sniffer = leg, on_end, sniffer
        self.status_code = leg.response.status_code
        self.media_type = leg.response.headers.get("content-type")
        self.background = None
        self.init_headers(_id_header(request_id))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "disconnected"
        try:
            outcome = await _unless_disconnected(receive, self._relay(send))
        except (ClientGone, OSError):      # ASGI 2.4 servers report a closed connection on send
            outcome = "disconnected"
        finally:
            with anyio.CancelScope(shield=True):
                await self.leg.response.aclose()
            self.on_end(outcome)

    async def _relay(self, send: Send) -> str:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        tail = b"\n\n"                   # the last two bytes relayed: are we between SSE events?
        try:
            async for chunk in self.leg.response.aiter_raw():
                if chunk:
                    if self.sniffer is not None:
                        self.sniffer.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    tail = (tail + chunk)[-2:]
        except httpx.TransportError as e:
            return await self._cut(send, e, tail == b"\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return "done"

    async def _cut(self, send: Send, e: httpx.TransportError, between_events: bool) -> str:
        """The decode stream broke. Between SSE events, end it the way kvrelay serve reports a
        failed stream (an error event, then [DONE]); otherwise leave the response incomplete,
        which makes the server drop the connection so the client sees the failure."""
        message = f"decode server {self.leg.backend.name} broke off the stream: {_describe(e)}"
        logger.warning(message)
        if between_events and (self.media_type or "").startswith("text/event-stream"):
            error = {"message": message, "type": "ServiceUnavailableError", "param": None,
                     "code": 503}
            tail = f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        return "upstream_error"


# ---------------------------------------------------------------------------- free notice

async def _send_free(state: ProxyState, prefilled: Prefilled, headers: dict[str, str],
                     request_id: str) -> None:
    body = free_notice(prefilled.kv_params)
    capability = prefilled.kv_params.get("remote_capability")
    if body is not None and capability:       # kvrelay prefills free only with it
        body["remote_capability"] = capability
    backend = prefilled.backend
    if body is None or backend.client is None:
        return
    try:
        resp = await backend.client.post(FREE_PATH, json=body, headers=headers,
                                         timeout=FREE_TIMEOUT_S)
        result = "sent" if resp.is_success else ("not_found" if resp.status_code == 404
                                                 else "rejected")
    except httpx.HTTPError as e:
        result = "error"
        logger.debug("request %s: free notice to %s failed: %s", request_id, backend.name,
                     _describe(e))
    state.metrics.free_notices.labels(result).inc()
    logger.debug("request %s: free notice to %s: %s", request_id, backend.name, result)


# ---------------------------------------------------------------------------- one request

async def relay_completion(state: ProxyState, request: Request, path: str) -> Response:
    """Prefill, then decode; returns what the client gets (see the module docstring)."""
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    try:
        read = await _read_body(request, request_id)
    except ClientDisconnect:
        return _finish(state, path, _client_closed(request_id, "while sending its body"))
    if isinstance(read, Response):
        return _finish(state, path, read)
    client_body = read
    headers = _backend_headers(state, request, request_id)
    key = None
    if client_body.size > INLINE_PARSE_BYTES and _needs_key(state):   # a long prompt: off the loop
        key = await asyncio.to_thread(_prompt_key, state, path, client_body)
    route = _route(state, path, client_body, request_id, key)
    prefilled: Prefilled | None = None
    if route.prefill is None:
        payload = client_body.payload({}, drop=("kv_transfer_params",))
    else:
        try:
            answer = await _unless_disconnected(
                request.receive,
                _prefill(state, path, client_body, headers, request_id, route.prefill.order))
        except ClientGone:
            return _finish(state, path, _client_closed(request_id, "during prefill"))
        if isinstance(answer, Response):
            return _finish(state, path, answer)
        prefilled = answer
        if route.prefill.decision == "cache_hit" and answer.backend is route.prefill.order[0]:
            assert route.key is not None
            answer.backend.expected_hits += route.key.cached_tokens(route.prefill.first_matched)
        state.record(route.key, answer.backend)
        kv = answer.kv_params
        logger.debug("request %s: prefill on %s took %.3fs (remote_request_id %s, KV at %s:%s)",
                     request_id, answer.backend.name, answer.seconds,
                     kv.get("remote_request_id"), kv.get("remote_host"), kv.get("remote_port"))
        payload = client_body.payload({"kv_transfer_params": kv})
    response = await _decode(state, request, path, payload, bool(client_body.get("stream")),
                             headers,
                             prefilled, request_id, route)
    if isinstance(response, RelayStream):
        return response              # counted when the stream ends (a client that leaves: 499)
    return _finish(state, path, response)


@dataclass
class Route:
    key: PromptKey | None
    decode: Choice
    prefill: Choice | None          # None: straight to decode (it prefills the prompt itself)


def _needs_key(state: ProxyState) -> bool:
    return state.routing.routing == "cache_aware" or state.routing.disagg.policy == "auto"


def _prompt_key(state: ProxyState, path: str, client_body: ClientBody) -> PromptKey | None:
    """The prompt's routing key (pure: safe on a worker thread); None for a prompt too
    deeply nested to walk (the server will refuse it)."""
    fields = client_body.fields
    try:
        return state.hasher.key(path, responses.key_body(fields) if path == responses.PATH
                                else fields, client_body.prompt_bytes)
    except (RecursionError, ValueError):
        return None


def _route(state: ProxyState, path: str, client_body: ClientBody, request_id: str,
           key: PromptKey | None = None) -> Route:
    """The servers to try for each leg, and whether there is a prefill leg at all; counted
    per decision in `kvrelay_proxy:routing_decisions_total` and logged at debug level.
    `key`: the prompt's key when already made (off the loop, for a large body)."""
    if key is None and _needs_key(state):
        key = _prompt_key(state, path, client_body)
    decode = state.decode_router.choose(key)
    direct, why = state.routing.disagg.direct(key, decode.first_matched)
    previous = client_body.get("previous_response_id") if path == responses.PATH else None
    if previous is not None:
        # The conversation so far is stored on the decode server that answered it, and only
        # there: no prefill leg (the prefill has not got it), and that server or none. An
        # id the proxy has not seen goes to the decode chosen as usual, which judges it.
        home = state.homes.home(previous) if isinstance(previous, str) else None
        if home is not None:
            decode = Choice([home], "stored_response")
        direct, why = True, "continues a stored response"
    prefill = None if direct else state.prefill_router.choose(key)
    m = state.metrics.decisions
    m.labels("disagg", "direct_to_decode" if direct else "prefill_then_decode").inc()
    m.labels("decode", decode.decision).inc()
    if prefill is not None:
        m.labels("prefill", prefill.decision).inc()
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("request %s: route: %s (%s); %sdecode %s", request_id,
                     "direct to decode" if direct else "prefill then decode", why,
                     "" if prefill is None else f"prefill {_describe_choice(prefill, key)}, ",
                     _describe_choice(decode, key))
    return Route(key, decode, prefill)


def _describe_choice(choice: Choice, key: PromptKey | None) -> str:
    first = choice.order[0]
    held = choice.first_matched
    blocks = f", {held}/{len(key.hashes)} blocks cached" if key is not None and key.hashes else ""
    return f"{first.name} ({choice.decision}{blocks}, load {first.in_flight})"


async def _decode(state: ProxyState, request: Request, path: str,
                  payload: Payload, stream: bool,
                  headers: dict[str, str], prefilled: Prefilled | None, request_id: str,
                  route: Route) -> Response:
    def free() -> None:
        if prefilled is not None:
            state.spawn(_send_free(state, prefilled, headers, request_id))

    try:
        leg = await _unless_disconnected(
            request.receive,
            _open_decode(state, path, payload, headers, request_id, route.decode.order))
    except ClientGone:
        free()
        return _client_closed(request_id, "before decode answered")
    if isinstance(leg, Response):
        free()
        return leg
    if leg.response.is_success:
        state.record(route.key, leg.backend)   # it holds the prompt now, pulled or computed

    def end(outcome: str) -> None:
        seconds = time.monotonic() - leg.started
        state.release(leg.backend)
        state.metrics.decode_latency.labels(leg.backend.name).observe(seconds)
        logger.debug("request %s: decode on %s: %s after %.3fs", request_id, leg.backend.name,
                     outcome, seconds)
        if outcome != "done":
            free()

    def end_stream(outcome: str) -> None:
        end(outcome)
        if outcome == "disconnected":
            _client_closed(request_id, "mid-stream")
        status = CLIENT_CLOSED if outcome == "disconnected" else leg.response.status_code
        state.metrics.requests.labels(path, str(status)).inc()

    if leg.response.is_success and stream:
        if path != responses.PATH:
            return RelayStream(leg, request_id, end_stream)
        sniffer = responses.StreamSniffer()

        def end_responses_stream(outcome: str) -> None:
            if outcome == "done" and sniffer.response_id:
                state.homes.remember(sniffer.response_id, leg.backend)
            end_stream(outcome)

        return RelayStream(leg, request_id, end_responses_stream, sniffer)
    response = await _decode_whole(request, leg, request_id, end)
    if path == responses.PATH and response.status_code == 200:
        response_id = responses.id_from_json(bytes(response.body))
        if response_id:
            state.homes.remember(response_id, leg.backend)
    return response


async def _decode_whole(request: Request, leg: DecodeLeg, request_id: str,
                        end: Callable[[str], None]) -> Response:
    """A non-streamed decode answer (or a decode error), read whole and returned as is."""
    outcome = "disconnected"
    try:
        content = await _unless_disconnected(request.receive, leg.response.aread())
        outcome = "done" if leg.response.is_success else f"http_{leg.response.status_code}"
        return _copy_response(leg.response, content, request_id)
    except ClientGone:
        return _client_closed(request_id, "before decode finished")
    except httpx.TransportError as e:
        outcome = "upstream_error"
        return _error(502, f"decode server {leg.backend.name} failed: {_describe(e)}",
                      "BadGatewayError", request_id)
    finally:
        with anyio.CancelScope(shield=True):
            await leg.response.aclose()
        end(outcome)


def _client_closed(request_id: str, when: str) -> Response:
    """What a request whose client went away ends with (nobody reads it; metrics and the
    log say 499, nginx's "client closed request")."""
    logger.info("request %s: client closed the connection %s (%d)", request_id, when, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


def _finish(state: ProxyState, path: str, response: Response) -> Response:
    state.metrics.requests.labels(path, str(response.status_code)).inc()
    return response


# ---------------------------------------------------------------------------- health, models

async def _probe(state: ProxyState, backend: Backend) -> str | None:
    """None when `GET /health` answers 200 within HEALTH_TIMEOUT_S, else why not."""
    assert state.health_client is not None
    try:
        resp = await state.health_client.get(f"{backend.url}/health")
    except httpx.TimeoutException:
        return _TIMED_OUT
    except httpx.TransportError as e:
        return _describe(e)
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


async def health(state: ProxyState) -> Response:
    reasons = await asyncio.gather(*(_probe(state, b) for b in state.backends))
    servers = [{"role": b.role, "server": b.name, "healthy": r is None,
                **({"error": r} if r else {})}
               for b, r in zip(state.backends, reasons)]
    down = [s for s in servers if not s["healthy"]]
    status = 503 if down else 200
    body = {"status": "unavailable" if down else "ok", "down": down, "servers": servers}
    return _finish(state, "/health", JSONResponse(body, status_code=status))


async def models(state: ProxyState, request: Request) -> Response:
    """`GET /v1/models` of a decode server (the next one if it cannot be reached)."""
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    headers = _backend_headers(state, request, request_id)
    failures: list[str] = []
    for backend in state.decode_router.choose(None).order:
        assert backend.client is not None
        try:
            resp = await backend.client.get("/v1/models", headers=headers,
                                            timeout=HEALTH_TIMEOUT_S * 5)
        except httpx.TransportError as e:
            state.failed(backend, "connect" if _is_connect_error(e) else "transport")
            failures.append(f"{backend.name} ({_describe(e)})")
            continue
        return _finish(state, "/v1/models", _copy_response(resp, resp.content, request_id))
    return _finish(state, "/v1/models", _error(503,
                                               "no decode server answered: " + "; ".join(failures),
                                               "ServiceUnavailableError", request_id))


async def stored_response(state: ProxyState, request: Request, method: str,
                          response_id: str) -> Response:
    """`GET` / `DELETE /v1/responses/{id}` on the decode server that stored the response
    (learned from the answers the proxy relayed); 404 when the proxy has not seen the id."""
    endpoint = responses.PATH + "/{id}"
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    backend = state.homes.home(response_id)
    if backend is None or backend.client is None:
        return _finish(state, endpoint, _error(
            404, f"Response with id '{response_id}' not found (this proxy has not relayed it).",
            "NotFoundError", request_id))
    headers = _backend_headers(state, request, request_id)
    try:
        resp = await backend.client.request(method, f"{responses.PATH}/{response_id}",
                                            headers=headers, timeout=HEALTH_TIMEOUT_S * 5)
    except httpx.TransportError as e:
        state.failed(backend, "connect" if _is_connect_error(e) else "transport")
        return _finish(state, endpoint, _error(
            503, f"decode server {backend.name}, which holds response '{response_id}', did not "
            f"answer: {_describe(e)}", "ServiceUnavailableError", request_id))
    if (method == "DELETE" and resp.is_success) or resp.status_code == 404:
        state.homes.forget(response_id)          # gone from that server (deleted or evicted)
    return _finish(state, endpoint, _copy_response(resp, resp.content, request_id))


# ---------------------------------------------------------------------------- the app

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLarge",
               422: "UnprocessableEntityError"}
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", responses.PATH)


class _RequireKey:
    """ASGI middleware: every /v1/ request presents the proxy's key (401 otherwise). Pure
    ASGI, so streamed responses and disconnect detection pass through untouched."""

    def __init__(self, app: Any, state: ProxyState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = Headers(scope=scope)
            if not self.state.auth.admits(headers.get("authorization")):
                response = _error(401, "invalid or missing API key: send 'Authorization: "
                                  "Bearer KEY' with the proxy's --api-key", "AuthenticationError",
                                  headers.get("x-request-id"))
                if scope["path"] in ENDPOINTS:
                    _finish(self.state, scope["path"], response)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error the proxy answers itself is an OpenAI error body (FastAPI's default is
    `{"detail": ...}`)."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = ERROR_TYPES.get(exc.status_code, "HTTPError")
        return _error(exc.status_code, str(exc.detail), type_, request.headers.get("x-request-id"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = (exc.errors() or [{}])[0]
        return _error(400, f"invalid request: {first.get('msg', 'malformed body')}",
                      "BadRequestError", request.headers.get("x-request-id"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal proxy error: {type(exc).__name__}", "InternalServerError",
                      request.headers.get("x-request-id"))


def build_app(prefill: list[tuple[str, int]], decode: list[tuple[str, int]],
              auth: ProxyAuth | None = None,
              health_interval_s: float = HEALTH_INTERVAL_S,
              routing: RoutingSettings | None = None,
              busy_retry_s: float = PREFILL_BUSY_RETRY_S) -> FastAPI:
    """The proxy app for these (host, port) prefill and decode servers."""
    state = ProxyState.create(prefill, decode, auth, health_interval_s, routing, busy_retry_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.open()
        r = state.routing
        logger.info("prefill servers (%s): %s", r.routing, ", ".join(b.url for b in state.prefill))
        logger.info("decode servers (%s): %s", r.routing, ", ".join(b.url for b in state.decode))
        logger.info("disaggregation: %s%s", r.disagg.policy,
                    f" (straight to decode at <= {r.disagg.direct_max_tokens} uncached tokens "
                    f"or >= {r.disagg.direct_cached_fraction:g} of the prompt cached there)"
                    if r.disagg.policy == "auto" else "")
        if state.auth.api_key is None and state.auth.backend_key:
            logger.warning("OPENAI_API_KEY is set but the proxy has no --api-key: it is not sent "
                           "to the backends (clients the proxy does not authenticate must present "
                           "their own key); set --api-key (or KVRELAY_API_KEY) to make the proxy "
                           "check clients and use it")
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="kvrelay proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.proxy = state
    _install_error_handlers(app)
    app.add_middleware(_RequireKey, state=state)

    @app.get("/health")
    async def _health() -> Response:
        return await health(state)

    @app.get("/v1/models")
    async def _models(request: Request) -> Response:
        return await models(state, request)

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        return await relay_completion(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await relay_completion(state, request, "/v1/chat/completions")

    @app.post(responses.PATH)
    async def _responses(request: Request) -> Response:
        return await relay_completion(state, request, responses.PATH)

    @app.get(responses.PATH + "/{response_id}")
    async def _get_response(response_id: str, request: Request) -> Response:
        return await stored_response(state, request, "GET", response_id)

    @app.delete(responses.PATH + "/{response_id}")
    async def _delete_response(response_id: str, request: Request) -> Response:
        return await stored_response(state, request, "DELETE", response_id)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
