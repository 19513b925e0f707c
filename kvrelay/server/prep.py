"""Request preparation off the event loop: the body's parse and checks, tokenising,
chat rendering and grammar checks run in worker threads, a bounded number at once.

    _Edge (api.py) reads the body (≤ 32 MiB) into a `BodyHolder` ─▶ `PreparedRoute`:
      scan_body (limits.py: containers / strings / numbers, on the raw bytes)
      → http_body.parse_json → check_shape (prompts, token ids, text bytes, messages, tools)
      → the route's pydantic model
    ─▶ FastAPI's own handler, which gets the validated model (no second parse)
    ─▶ the endpoint, which runs its tokenising / rendering / grammar work through
       `ServerState.prep` (`PrepPool.run`)

A body of at most `INLINE_BYTES` is prepared on the event loop (a few milliseconds; no
thread hop, no queueing behind large requests); anything larger, and every grammar
check, runs on one of `PrepPool.workers` threads (the cores, at most `MAX_WORKERS`);
requests beyond that wait their turn in the pool's queue. The work releases the GIL
where it is long (the tokenizer's batch encode, pure-Python checks), so `/health` and
streams keep being answered while it runs. Two exceptions hold the GIL for their whole
call, bounded by the limits in front of them: the JSON parse (≤ 4 Mi numbers, 64 Ki
containers: ~0.3 s) and pydantic's validation of what it produced.

The raw body is handed from the door to the parse through the holder, so it is dropped
as soon as it is parsed rather than kept for the length of the request.
"""
from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Coroutine, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from kvrelay import http_body
from kvrelay.server.limits import RequestLimits, check_raw_fields, check_shape, scan_body
from kvrelay.server.protocol import OpenAIError

INLINE_BYTES = 64 * 1024
MAX_WORKERS = 16
BODY_KEY = "kvrelay.body"

T = TypeVar("T")
Receive = Callable[[], Coroutine[Any, Any, MutableMapping[str, Any]]]


def default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                       # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


_EXECUTOR: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    """One pool for the process: every app (tests build many) shares its threads."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(default_workers(), thread_name_prefix="kvrelay-prep")
    return _EXECUTOR


class PrepPool:
    """Runs request preparation: inline for small requests, else on the shared worker
    threads (`workers` at once, the rest queue)."""

    def __init__(self) -> None:
        self.workers = default_workers()
        self.in_flight = 0                       # jobs submitted and not yet finished

    async def run(self, fn: Callable[..., T], *args: Any, size: int = INLINE_BYTES + 1) -> T:
        """`fn(*args)`: on the event loop when `size` (the request body's bytes) is at most
        INLINE_BYTES, else on a worker thread."""
        if size <= INLINE_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        try:
            return await loop.run_in_executor(_executor(), functools.partial(fn, *args))
        finally:
            self.in_flight -= 1


class BodyHolder:
    """The request body between the door and its parse; `take` hands it over once."""

    def __init__(self, body: bytes) -> None:
        self.size = len(body)
        self._body: bytes | None = body

    def take(self) -> bytes:
        body, self._body = self._body or b"", None
        return body

    def replay(self, receive: Receive) -> Receive:
        """A receive that gives the app the body (unless it was taken), then the client's
        messages (so disconnects still reach streaming responses)."""
        sent = False

        async def again() -> MutableMapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": self.take(), "more_body": False}
            return await receive()
        return again


def body_size(request: Request) -> int:
    """The request body's size in bytes (0 when the door read none)."""
    holder = request.scope.get("state", {}).get(BODY_KEY)
    return holder.size if isinstance(holder, BodyHolder) else 0


def body_error(e: http_body.BodyError) -> OpenAIError:
    return OpenAIError(e.message, e.status,
                       "RequestTooLarge" if e.status == 413 else "BadRequestError", e.param)


def prepare_body(holder: BodyHolder, path: str, model: type[BaseModel],
                 limits: RequestLimits) -> BaseModel:
    """The body as `model`: bounded, parsed, shape-checked and validated. OpenAIError
    (400 / 413) or RequestValidationError (pydantic's, answered as a 400)."""
    raw = holder.take()
    scan_body(raw, limits)
    check_raw_fields(path, raw, limits)
    try:
        decoded = http_body.decode(raw)
        del raw                   # the parse holds the text and the value: 2x the body, not 3x
        value = http_body.parse_text(decoded)
    except http_body.BodyError as e:
        raise body_error(e) from None
    del decoded                                   # the parsed value is all that is kept
    check_shape(path, value, limits)
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False, include_context=False)
        raise RequestValidationError(errors) from None


def _fastapi_parses_json(content_type: str | None) -> bool:
    """FastAPI (strict content type) parses a body as JSON only with a JSON content type."""
    if not content_type:
        return False
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


class _Prepared(Request):
    """The request FastAPI's handler gets: its body is the validated model already."""

    def __init__(self, request: Request, value: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self._body = b"{}"          # FastAPI only asks whether there is one, then for json()
        self._value = value

    async def json(self) -> Any:
        return self._value


class PreparedRoute(APIRoute):
    """An APIRoute whose JSON body is prepared by `prepare_body` (off the event loop when
    large) before FastAPI's own handler sees it. The OpenAPI schema is FastAPI's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler
        path = self.path

        async def route(request: Request) -> Response:
            holder = request.scope.get("state", {}).get(BODY_KEY)
            if (not isinstance(holder, BodyHolder) or not holder.size
                    or not _fastapi_parses_json(request.headers.get("content-type"))):
                return await handler(request)          # FastAPI's own answer (400s)
            state = request.app.state.kvrelay
            value = await state.prep.run(prepare_body, holder, path, model,
                                         state.request_limits(), size=holder.size)
            return await handler(_Prepared(request, value))
        return route


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model of the route's one JSON body parameter, if it has one."""
    field = route.body_field
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None
