"""The OpenAI-compatible HTTP API: the door, the error handlers, and `build_app`, which
puts the routes (`server/routes/`, one APIRouter per endpoint family) behind them.

Request path: the door (`_Edge`: auth, 503 + Retry-After until the engine is ready, the
body read bounded) → `PreparedRoute` bounds, parses and validates the body (pydantic),
off the event loop when it is large (`server/prep.py`, `server/limits.py`) → the route
tokenises / renders the chat and checks lengths on a prep worker (`ServerState.prep`) →
`EngineClient.generate` (engine-core process) yields accumulated outputs → responses are
shaped as OpenAI's, streamed as SSE when asked. Client mistakes are 4xx with OpenAI's
error object; a disconnect aborts the request in the engine (its KV blocks are freed at
once).

Every error leaves as OpenAI's error object, whatever raised it: the door (`_Edge`:
auth, readiness, body size as it streams), the body's preparation (`PreparedRoute`: the
caps of `server/limits.py`, JSON that parses to something the tokenizer and pydantic can
take — `kvrelay/http_body.py`), pydantic validation, FastAPI's 404/405, the
engine (400 naming the field, 500 for a request that failed inside the engine while
the others went on, 502 a failed KV transfer, 503 a dead engine or a prefill whose
`hold_share` is full, with Retry-After), a client over its `hold_rate` of
`do_remote_decode` holds (429, Retry-After), a request of too many sequences (400) or a
full queue (503, Retry-After: `server/admission.py`) and anything unexpected (500). Sampling
parameters and token ids are validated against the model (`validate_for_model`) before
a request reaches the engine.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay import http_auth, http_body
from kvrelay.engine.client import (
    EngineDeadError,
    EngineError,
    KVHoldRefused,
    KVTransferFailed,
    RequestFailed,
)
from kvrelay.server.prep import BODY_KEY, BodyHolder, PreparedRoute, body_error
from kvrelay.server.protocol import OpenAIError, error_type_for
from kvrelay.server.routes import completions, info, kv_transfer, responses
from kvrelay.server.routes.responses import open_responses
from kvrelay.server.serving import HOLD_RETRY_AFTER_S, ServerState, _Busy

logger = logging.getLogger(__name__)


class _Edge:
    """Checks at the door, as a pure ASGI middleware (starlette's BaseHTTPMiddleware
    re-queues every streamed chunk through a memory stream — a quarter of the API
    process's CPU per token at 64 streams): request id, API key, body-size limit and
    readiness, and `X-Request-Id` on every response."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        refusal = self._refusal(scope["path"], scope["method"], headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await http_body.read_limited(http_body.asgi_chunks(receive))
            except http_body.ClientGone:
                return
            except http_body.BodyError as e:     # over the limit while streaming in (chunked)
                refusal = _error_response(body_error(e))
            else:
                # parsed and checked by the route (server/prep.py), off the loop if large
                holder = BodyHolder(body)
                del body
                scope["state"][BODY_KEY] = holder
                receive = holder.replay(receive)
        app = refusal or self.app
        await app(scope, receive, send_with_id)

    def _refusal(self, path: str, method: str, headers: Headers) -> JSONResponse | None:
        state = self.state
        if (state.api_key and path.startswith("/v1/")
                and not http_auth.bearer_matches(headers.get("authorization"), [state.api_key])):
            return JSONResponse(
                OpenAIError("invalid or missing API key", 401, "AuthenticationError").body(),
                status_code=401)
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > http_body.MAX_BODY_BYTES:
            return _error_response(body_error(http_body.too_large()))
        if path.startswith("/v1/") and not state.ready:
            return _not_ready(state)
        return None


# a starting server is ready in seconds to minutes; a draining one never again (the proxy
# and OpenAI's clients retry a 503 with Retry-After, the proxy at another server)
NOT_READY_RETRY_AFTER_S = 2


def _not_ready(state: ServerState) -> JSONResponse:
    """Every /v1 route until the engine is ready (the state /health reports): 503 with
    Retry-After, nothing of the request read or checked."""
    why = ("the server is shutting down" if not state.accepting else
           "the engine has stopped" if state.engine.dead else
           "the server is starting: the engine is not ready yet")
    error = OpenAIError(f"{why}; retry after {NOT_READY_RETRY_AFTER_S} s", 503,
                        "ServiceUnavailableError")
    return _error_response(error, {"Retry-After": str(NOT_READY_RETRY_AFTER_S)})


def _error_response(error: OpenAIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Whatever goes wrong, the client gets OpenAI's error object (never FastAPI's
    `{"detail": ...}` or a plain-text 500)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc, getattr(exc, "headers", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = OpenAIError(str(exc.detail), exc.status_code, error_type_for(exc.status_code))
        return _error_response(error, exc.headers)         # 405 keeps its Allow header

    @app.exception_handler(EngineError)
    async def _engine_refused(_: Request, exc: EngineError) -> JSONResponse:
        return _error_response(OpenAIError(str(exc), param=exc.param))

    @app.exception_handler(RequestFailed)
    async def _request_failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return _error_response(OpenAIError(str(exc), 500, "InternalServerError"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__,
                     exc, exc_info=exc)
        return _error_response(OpenAIError("internal server error", 500, "InternalServerError"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', 'invalid JSON')}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(OpenAIError(message, param=".".join(loc) or None).body(),
                            status_code=400)

    @app.exception_handler(KVHoldRefused)
    async def _hold_refused(_: Request, exc: KVHoldRefused) -> JSONResponse:
        busy = _Busy(str(exc), 503, "ServiceUnavailableError", HOLD_RETRY_AFTER_S)
        return _error_response(busy, busy.headers)

    @app.exception_handler(KVTransferFailed)
    async def _kv_failed(_: Request, exc: KVTransferFailed) -> JSONResponse:
        body = {"error": {"message": str(exc), "type": "KVTransferError", "param": None,
                          "code": 502}}
        return JSONResponse(body, status_code=502)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        body = {"error": {"message": str(exc), "type": "ServiceUnavailableError", "param": None,
                          "code": 503}}
        return JSONResponse(body, status_code=503)


# -- the app --------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None)
    app.router.route_class = PreparedRoute     # bodies parsed + checked off the loop
    app.state.kvrelay = state
    _install_error_handlers(app)
    app.add_middleware(_Edge, state=state)
    open_responses(app, state)
    for router in (info.router, completions.router, kv_transfer.router, responses.router):
        app.include_router(router)
    return app
