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
`responses.py`'s); a `previous_response_id` follow-up, GET (its query too: a resumed stream
is relayed as SSE), DELETE and cancel go to the decode server that stored the response
(`responses.ResponseHomes`, learned from relayed answers); a body that approves an MCP call
goes straight to decode (`responses.approves_a_call`: its first prompt holds the call's
result, which only the decode makes).
Every error the proxy itself returns is an OpenAI error body.

Rooms: this file is the app and one request's path (`relay_completion`); the body is
`body.py`'s, the backends and their probe `state.py`'s, the legs `legs.py`'s, relaying the
decode's answer `relay.py`'s, the proxy's own answers `answers.py`'s, metrics `metrics.py`'s.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
)
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvrelay import http_body
from kvrelay.proxy import responses
from kvrelay.proxy.answers import (
    CLIENT_CLOSED,
    client_closed,
    copy_response,
    describe,
    error_response,
    is_connect_error,
)
from kvrelay.proxy.backend_set import BackendsFile
from kvrelay.proxy.body import INLINE_PARSE_BYTES, ClientBody, Payload, parse_body, read_body
from kvrelay.proxy.legs import DecodeLeg, Prefilled, open_decode, run_prefill, send_free
from kvrelay.proxy.policy import Choice, RoutingSettings
from kvrelay.proxy.prefix import PromptKey
from kvrelay.proxy.relay import ClientGone, RelayStream, decode_whole, unless_disconnected
from kvrelay.proxy.state import (
    HEALTH_INTERVAL_S,
    HEALTH_TIMEOUT_S,
    PREFILL_BUSY_RETRY_S,
    ProxyAuth,
    ProxyState,
    probe,
)

logger = logging.getLogger("kvrelay.proxy")


def _backend_headers(state: ProxyState, request: Request, request_id: str) -> dict[str, str]:
    """X-Request-Id for both legs, and the Authorization `ProxyAuth` chooses."""
    headers = {"X-Request-Id": request_id}
    auth = state.auth.backend_authorization(request.headers.get("authorization"))
    if auth:
        headers["Authorization"] = auth
    return headers


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
        return error_response(e.status, e.message, type_, request_id, e.param)


async def relay_completion(state: ProxyState, request: Request, path: str) -> Response:
    """Prefill, then decode; returns what the client gets (see the module docstring)."""
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    try:
        read = await _read_body(request, request_id)
    except ClientDisconnect:
        return _finish(state, path, client_closed(request_id, "while sending its body"))
    if isinstance(read, Response):
        return _finish(state, path, read)
    client_body = read
    headers = _backend_headers(state, request, request_id)
    key = None
    if client_body.size > INLINE_PARSE_BYTES and _needs_key(state):   # a long prompt: off the loop
        key = await asyncio.to_thread(_prompt_key, state, path, client_body)
    route = _route(state, path, client_body, request_id, key)
    unserved = state.unserved(route.prefill, route.decode, request_id)
    if unserved is not None:                 # a backends file with no server for a leg yet
        return _finish(state, path, unserved)
    prefilled: Prefilled | None = None
    if route.prefill is None:
        payload = client_body.payload({}, drop=("kv_transfer_params",))
    else:
        try:
            answer = await unless_disconnected(
                request.receive,
                run_prefill(state, path, client_body, headers, request_id, route.prefill.order))
        except ClientGone:
            return _finish(state, path, client_closed(request_id, "during prefill"))
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
    decode = _DecodeCall(state, request, path, headers, prefilled, request_id)
    response = await decode.run(payload, route, bool(client_body.get("stream")))
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
    elif path == responses.PATH and responses.approves_a_call(client_body.raw, client_body.fields):
        direct, why = True, "approves an MCP call (made on the decode, its result in the prompt)"
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
    if not choice.order:
        return "none (no server takes requests)"
    first = choice.order[0]
    held = choice.first_matched
    blocks = f", {held}/{len(key.hashes)} blocks cached" if key is not None and key.hashes else ""
    return f"{first.name} ({choice.decision}{blocks}, load {first.in_flight})"


@dataclass(frozen=True)
class _DecodeCall:
    """One request's decode leg, from opening it to its end. Its end settles the prefill's
    hold: a decode that finished (it pulled the KV) lets the prefill server go; any other
    end, or a leg that never opened, sends the prefill a free notice."""

    state: ProxyState
    request: Request
    path: str
    headers: dict[str, str]
    prefilled: Prefilled | None
    request_id: str

    async def run(self, payload: Payload, route: Route, stream: bool) -> Response:
        leg = await self._open(payload, route)
        if isinstance(leg, Response):
            return leg
        if leg.response.is_success:
            self.state.record(route.key, leg.backend)   # it holds the prompt now (pulled/computed)
        if leg.response.is_success and stream:
            return self._relay_stream(leg)
        return await self._read_whole(leg)

    async def _open(self, payload: Payload, route: Route) -> DecodeLeg | Response:
        try:
            leg = await unless_disconnected(
                self.request.receive,
                open_decode(self.state, self.path, payload, self.headers, self.request_id,
                            route.decode.order))
        except ClientGone:
            self._free()
            return client_closed(self.request_id, "before decode answered")
        except Exception as e:              # a proxy bug: the prefill still lets go (free notice)
            self._free()
            return _decode_failed(e, self.request_id, self.path)
        except BaseException:               # cancelled: the same, then the cancellation goes on
            self._free()
            raise
        if isinstance(leg, Response):
            self._free()
        return leg

    def _relay_stream(self, leg: DecodeLeg) -> RelayStream:
        """Counted in `requests` when the stream ends; a Responses stream's id is remembered
        as stored on this decode server."""
        if self.path != responses.PATH:
            return RelayStream(leg, self.request_id, functools.partial(self._end_stream, leg))
        sniffer = responses.StreamSniffer()

        def end_responses_stream(outcome: str) -> None:
            if outcome == "done" and sniffer.response_id:
                self.state.homes.remember(sniffer.response_id, leg.backend)
            self._end_stream(leg, outcome)

        return RelayStream(leg, self.request_id, end_responses_stream, sniffer)

    async def _read_whole(self, leg: DecodeLeg) -> Response:
        response = await decode_whole(self.request, leg, self.request_id,
                                      functools.partial(self._end, leg))
        if self.path == responses.PATH and response.status_code == 200:
            response_id = responses.id_from_json(bytes(response.body))
            if response_id:
                self.state.homes.remember(response_id, leg.backend)
        return response

    def _end(self, leg: DecodeLeg, outcome: str) -> None:
        seconds = time.monotonic() - leg.started
        self.state.release(leg.backend)
        self.state.metrics.decode_latency.labels(leg.backend.name).observe(seconds)
        logger.debug("request %s: decode on %s: %s after %.3fs", self.request_id,
                     leg.backend.name, outcome, seconds)
        if outcome != "done":
            self._free()
        elif self.prefilled is not None:     # the decode pulled its KV: the prefill is free
            self.state.let_go(self.prefilled.backend)

    def _end_stream(self, leg: DecodeLeg, outcome: str) -> None:
        self._end(leg, outcome)
        if outcome == "disconnected":
            client_closed(self.request_id, "mid-stream")
        status = CLIENT_CLOSED if outcome == "disconnected" else leg.response.status_code
        self.state.metrics.requests.labels(self.path, str(status)).inc()

    def _free(self) -> None:
        if self.prefilled is not None:
            self.state.spawn(send_free(self.state, self.prefilled, self.headers,
                                       self.request_id))


def _decode_failed(e: Exception, request_id: str, path: str) -> Response:
    """Opening the decode leg raised what no path handles: logged with its traceback (as
    the app's last-resort handler does), and the client gets 502 as for any decode leg that
    did not answer (`open_decode` released the decode server already)."""
    logger.error("request %s: internal error opening the decode leg of %s", request_id, path,
                 exc_info=e)
    return error_response(502, f"decode leg failed: internal proxy error: {type(e).__name__}",
                          "BadGatewayError", request_id)


def _finish(state: ProxyState, path: str, response: Response) -> Response:
    state.metrics.requests.labels(path, str(response.status_code)).inc()
    return response


async def health(state: ProxyState) -> Response:
    reasons = await asyncio.gather(*(probe(state, b) for b in state.backends))
    servers = [{"role": b.role, "server": b.name, "healthy": r is None,
                **({"error": r} if r else {})}
               for b, r in zip(state.backends, reasons)]
    down = [s for s in servers if not s["healthy"]] + state.empty_roles()
    status = 503 if down else 200
    body = {"status": "unavailable" if down else "ok", "down": down, "servers": servers}
    return _finish(state, "/health", JSONResponse(body, status_code=status))


async def models(state: ProxyState, request: Request) -> Response:
    """`GET /v1/models` of a decode server (the next one if it cannot be reached)."""
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    headers = _backend_headers(state, request, request_id)
    choice = state.decode_router.choose(None)
    unserved = state.unserved(None, choice, request_id)   # none listed, ready or undrained
    if unserved is not None:
        return _finish(state, "/v1/models", unserved)
    failures: list[str] = []
    for backend in state.takers(choice.order, "decode"):
        assert backend.client is not None
        try:
            resp = await backend.client.get("/v1/models", headers=headers,
                                            timeout=HEALTH_TIMEOUT_S * 5)
        except httpx.TransportError as e:
            state.failed(backend, "connect" if is_connect_error(e) else "transport")
            failures.append(f"{backend.name} ({describe(e)})")
            continue
        return _finish(state, "/v1/models", copy_response(resp, resp.content, request_id))
    why = "; ".join(failures) or "none takes requests now"
    return _finish(state, "/v1/models", error_response(
        503, f"no decode server answered: {why}", "ServiceUnavailableError", request_id))


async def stored_response(state: ProxyState, request: Request, method: str,
                          response_id: str, action: str = "") -> Response:
    """`GET` / `DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` (`action`)
    on the decode server that stored the response (learned from the answers the proxy
    relayed); 404 when the proxy has not seen the id. The query goes along (a background
    response's `?stream=true&starting_after=N`), and an SSE answer is relayed as it comes
    (`RelayStream`: no read timeout, the client leaving closes it)."""
    endpoint = responses.PATH + "/{id}" + action
    request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
    backend = state.homes.home(response_id)
    if backend is None or backend.client is None:
        return _finish(state, endpoint, error_response(
            404, f"Response with id '{response_id}' not found (this proxy has not relayed it).",
            "NotFoundError", request_id))
    headers = _backend_headers(state, request, request_id)
    streamed = method == "GET" and "stream" in request.query_params
    timeout = httpx.Timeout(HEALTH_TIMEOUT_S * 5, read=None if streamed else HEALTH_TIMEOUT_S * 5)
    state.acquire(backend)               # in flight until its answer ends: a drain waits for it
    relayed: RelayStream | None = None
    try:
        try:
            resp = await backend.client.send(backend.client.build_request(
                method, f"{responses.PATH}/{response_id}{action}", params=request.query_params,
                headers=headers, timeout=timeout), stream=True)
        except httpx.TransportError as e:
            state.failed(backend, "connect" if is_connect_error(e) else "transport")
            return _finish(state, endpoint, error_response(
                503, f"decode server {backend.name}, which holds response '{response_id}', did "
                f"not answer: {describe(e)}", "ServiceUnavailableError", request_id))
        if resp.is_success and resp.headers.get("content-type", "").startswith(
                "text/event-stream"):
            def end(outcome: str) -> None:   # the stream ended: whole, cut, or the client left
                state.release(backend)
                status = CLIENT_CLOSED if outcome == "disconnected" else resp.status_code
                state.metrics.requests.labels(endpoint, str(status)).inc()
            relayed = RelayStream(DecodeLeg(backend, resp, time.monotonic()), request_id, end)
            return relayed
        try:
            content = await resp.aread()
        except httpx.TransportError as e:
            return _finish(state, endpoint, error_response(
                502, f"decode server {backend.name} failed: {describe(e)}", "BadGatewayError",
                request_id))
        finally:
            await resp.aclose()
    finally:
        if relayed is None:              # else the stream releases it when it ends
            state.release(backend)
    if (method == "DELETE" and resp.is_success) or resp.status_code == 404:
        state.homes.forget(response_id)          # gone from that server (deleted or evicted)
    return _finish(state, endpoint, copy_response(resp, content, request_id))


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
                response = error_response(
                    401, "invalid or missing API key: send 'Authorization: Bearer KEY' with the "
                    "proxy's --api-key", "AuthenticationError", headers.get("x-request-id"))
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
        return error_response(exc.status_code, str(exc.detail), type_,
                              request.headers.get("x-request-id"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = (exc.errors() or [{}])[0]
        return error_response(400, f"invalid request: {first.get('msg', 'malformed body')}",
                              "BadRequestError", request.headers.get("x-request-id"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal proxy error: {type(exc).__name__}",
                              "InternalServerError", request.headers.get("x-request-id"))


def build_app(prefill: list[tuple[str, int]], decode: list[tuple[str, int]],
              auth: ProxyAuth | None = None,
              health_interval_s: float = HEALTH_INTERVAL_S,
              routing: RoutingSettings | None = None,
              busy_retry_s: float = PREFILL_BUSY_RETRY_S,
              backends_file: BackendsFile | None = None) -> FastAPI:
    """The proxy app for these (host, port) prefill and decode servers, or for those
    `backends_file` lists (and will list: state.py)."""
    state = ProxyState.create(prefill, decode, auth, health_interval_s, routing, busy_retry_s,
                              backends_file)

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

    @app.post(responses.PATH + "/{response_id}/cancel")
    async def _cancel_response(response_id: str, request: Request) -> Response:
        return await stored_response(state, request, "POST", response_id, "/cancel")

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
