"""The OpenAI-compatible HTTP API.

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

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, MutableMapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
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
from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import structured_hooks
from kvrelay.server.admission import AdmittedEngine
from kvrelay.server.chat import finish_reason
from kvrelay.server.harmony_chat import calls_limited
from kvrelay.server.prep import (
    BODY_KEY,
    INLINE_BYTES,
    BodyHolder,
    PreparedRoute,
    body_error,
    body_size,
)
from kvrelay.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_type_for,
    resolve_reasoning,
    without_reasoning,
)
from kvrelay.server.response_routes import add_responses_routes
from kvrelay.server.serving import (
    HOLD_RETRY_AFTER_S,
    CompletionChunks,
    ServerState,
    _Busy,
    _chat_logprobs,
    _check_lengths,
    _check_model,
    _collect,
    _completion_logprobs,
    _merge,
    _prompts,
    _sampling,
    _sse,
    _Timing,
    _until_disconnect,
    kv_transfer_params,
    refund_hold,
    take_hold,
)
from kvrelay.server.structured import is_harmony_chat, request_constraint
from kvrelay.server.tools import check_chat_tool_choice

logger = logging.getLogger(__name__)




class KVTransferFreeRequest(BaseModel):
    """`POST /v1/kv_transfer/free`: the prefill's kv_transfer_params name the request and
    its capability (kvrelay's proxy sends them when a decode will not read)."""
    remote_request_id: str = Field(min_length=1, max_length=1024)
    remote_capability: str = Field(min_length=1, max_length=256)
    remote_engine_id: str | None = None


# -- helpers --------------------------------------------------------------------------------










# a hold refused for the hold share: holds go back as decodes read them (ms to s), or at
# the latest after the lease; clients (OpenAI's retries 429 and 5xx) come back after this






























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


def _stream_error(e: Exception) -> dict[str, Any]:
    """The error event a stream ends with when the engine fails its request."""
    if isinstance(e, EngineError):
        return OpenAIError(str(e), param=e.param).body()
    kinds: dict[type[Exception], tuple[str, int]] = {
        KVTransferFailed: ("KVTransferError", 502),
        RequestFailed: ("InternalServerError", 500),
        KVHoldRefused: ("ServiceUnavailableError", 503)}
    kind, code = kinds.get(type(e), ("ServiceUnavailableError", 503))
    return {"error": {"message": str(e), "type": kind, "param": None, "code": code}}


def _model_root(state: ServerState) -> str | None:
    """The checkpoint directory the engine loaded (absolute), once it is known: `/v1/models`'
    `root`, so a client on this machine (`kvrelay bench serve`'s default tokenizer,
    `kvrelay validate`) can tell which model answers under a --served-model-name."""
    model_dir = getattr(getattr(state.engine, "info", None), "model_dir", None)
    return os.path.abspath(model_dir) if isinstance(model_dir, str) and model_dir else None


def _batch_of(prompt: Any) -> int:
    """How many prompts a completion's `prompt` holds, from its shape."""
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return len(prompt) if batch else 1


def _check_batch_size(state: ServerState, body: CompletionRequest) -> None:
    """400 for prompts × n over --max-seqs-per-request, from the body's shape alone."""
    if isinstance(state.engine, AdmittedEngine):
        state.engine.admission.check_size(_batch_of(body.prompt), body.n)


_GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar")


def _prep_size(request: Request, body: Any) -> int:
    """The size `PrepPool.run` goes by: the body's, except that a request with an output
    constraint always goes to a worker (a small grammar can take seconds to check)."""
    if any(getattr(body, name, None) is not None for name in _GRAMMAR_FIELDS):
        return INLINE_BYTES + 1
    return body_size(request)


def _prepare_completion(state: ServerState, body: CompletionRequest
                        ) -> tuple[list[tuple[str | None, list[int]]], list[Any]]:
    """Tokenise the prompts, check the constraint and lengths, build each prompt's
    sampling parameters (on a prep worker for large requests: server/prep.py)."""
    prompts = _prompts(state, body.prompt)
    structured = request_constraint(body)
    params = []
    for _, ids in prompts:
        max_tokens = _check_lengths(state, ids, body.max_tokens)
        params.append(_sampling(state, body, max_tokens, body.logprobs, body.prompt_logprobs,
                                structured=structured))
    return prompts, params


def _prepare_chat(state: ServerState, body: ChatCompletionRequest) -> tuple[Any, Any]:
    """Render and tokenise the chat, check the constraint and length, build the sampling
    parameters (on a prep worker for large requests: server/prep.py)."""
    assert state.chat is not None, "the endpoint answers 400 without a chat template"
    rendered = state.chat.render(body, state.max_model_len)
    if not is_harmony_chat(state.chat):       # harmony's chat format carries the calls
        check_chat_tool_choice(rendered.tools, state.agent)
    max_tokens = _check_lengths(state, rendered.prompt_ids, body.max_new_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None   # logprobs alone: the chosen
    params = structured_hooks.attach(
        _sampling(state, body, max_tokens, top,
                  extra_stop_ids=rendered.stop_token_ids, logprobs_param="top_logprobs",
                  structured=request_constraint(body, is_harmony_chat(state.chat))),
        rendered.structured, rendered.tools, body)
    return rendered, params


def _admitted_batch(state: ServerState, prompts: int, n: int) -> contextlib.AbstractContextManager:
    """A completion's prompts × n admitted whole (server/admission.py); an engine without
    admission (tests' fakes) takes anything."""
    if isinstance(state.engine, AdmittedEngine):
        return state.engine.batch(prompts, n)
    return contextlib.nullcontext()


# -- the app --------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None)
    app.router.route_class = PreparedRoute     # bodies parsed + checked off the loop
    app.state.kvrelay = state
    _install_error_handlers(app)

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

    app.add_middleware(_Edge, state=state)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.ready else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        root = _model_root(state)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "kvrelay",
             "root": root or name, "max_model_len": state.max_model_len}
            for name in state.served_names]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render() if state.metrics else b"",
                        media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model = _check_model(state, body.model)
        kv = kv_transfer_params(body.kv_transfer_params)
        _check_batch_size(state, body)                       # before tokenising 100k prompts
        if body.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if body.kv_transfer_params and _batch_of(body.prompt) > 1:
            raise OpenAIError("kv_transfer_params needs a single prompt", param="prompt")
        prompts, params = await state.prep.run(_prepare_completion, state, body,
                                               size=_prep_size(request, body))
        base_id = f"cmpl-{request.state.request_id}"
        created = int(time.time())
        take_hold(state, request, kv)                       # 429 before the engine holds
        try:
            with _admitted_batch(state, len(prompts), body.n):  # 400 / 503 before any stream
                gens = [state.engine.generate(f"{base_id}-{i}", ids, p, body.kv_transfer_params)
                        for i, ((_, ids), p) in enumerate(zip(prompts, params))]
        except OpenAIError:
            refund_hold(state, request, kv)                 # refused: it holds nothing
            raise
        if body.stream:
            return StreamingResponse(_stream_completions(state, body, model, base_id, created,
                                                         prompts, gens),
                                     media_type="text/event-stream")
        finals = await _until_disconnect(request,
                                         asyncio.ensure_future(_collect(state, gens, prompts)))
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            text_prefix = ""
            if body.echo:
                prompt_text = prompts[i][0]
                text_prefix = prompt_text if prompt_text is not None else (
                    state.tokenizer.decode(out.prompt_token_ids) if state.tokenizer else "")
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                choices.append({"index": i * body.n + o.index, "text": text_prefix + o.text,
                                "logprobs": _completion_logprobs(state, o.token_ids, o.logprobs,
                                                                 len(text_prefix)),
                                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"id": base_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                              "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens},
                **({"kv_transfer_params": finals[0].kv_transfer_params} if body.kv_transfer_params
                   else {})}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = _check_model(state, body.model)
        kv = kv_transfer_params(body.kv_transfer_params)
        if state.chat is None:
            raise OpenAIError("this model has no chat template", param="messages")
        hide_reasoning = resolve_reasoning(body)
        rendered, params = await state.prep.run(_prepare_chat, state, body,
                                                size=_prep_size(request, body))
        base_id = f"chatcmpl-{request.state.request_id}"
        created = int(time.time())
        take_hold(state, request, kv)                       # 429 before the engine holds
        try:
            gen = calls_limited(state.engine.generate(base_id, rendered.prompt_ids, params,
                                                      body.kv_transfer_params),
                                rendered.tools, state.chat)
        except OpenAIError:
            refund_hold(state, request, kv)                 # refused: it holds nothing
            raise
        if body.stream:
            return StreamingResponse(_stream_chat(state, body, model, base_id, created, rendered,
                                                  gen, hide_reasoning),
                                     media_type="text/event-stream")
        (final,) = await _until_disconnect(request, asyncio.ensure_future(
            _collect(state, [gen], [(None, rendered.prompt_ids)])))
        choices, completion_tokens = [], 0
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            parsed = state.chat.parse(o.token_ids, o.text, rendered.tools)
            message = parsed.message()
            choices.append({"index": o.index,
                            "message": without_reasoning(message) if hide_reasoning else message,
                            "logprobs": _chat_logprobs(state, o.token_ids, o.logprobs,
                                                       body.top_logprobs or 0),
                            "finish_reason": finish_reason(o.finish_reason,
                                                           bool(parsed.tool_calls)),
                            "stop_reason": o.stop_reason})
        prompt_tokens = len(rendered.prompt_ids)
        return {"id": base_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                              "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens},
                **({"kv_transfer_params": final.kv_transfer_params} if body.kv_transfer_params
                   else {})}

    @app.post("/v1/kv_transfer/free")
    async def kv_transfer_free(body: KVTransferFreeRequest):
        """Prefill side: release blocks held for a decode that will not read them. Only
        with the request's remote_capability; an unknown id and a wrong capability get
        the same 404, so the answer tells nothing about other requests."""
        if not await state.engine.free_remote(body.remote_request_id, body.remote_capability):
            raise OpenAIError("no KV blocks are held for this remote_request_id with this "
                              "remote_capability", 404, "NotFoundError", "remote_request_id")
        return {"ok": True}

    add_responses_routes(app, state)
    return app




async def _stream_completions(state: ServerState, body: CompletionRequest, model: str, base_id: str,
                              created: int, prompts: list[tuple[str | None, list[int]]],
                              gens: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    timings = [_Timing(state.metrics) for _ in gens]
    chunks = CompletionChunks(base_id, created, model)
    completion_tokens = 0
    echoed: set[tuple[int, int]] = set()
    offsets: dict[tuple[int, int], int] = {}
    try:
        async for i, out in _merge(gens):
            new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
            timings[i].tokens_arrived(new_tokens)
            completion_tokens += new_tokens
            for o in out.outputs:
                if not o.delta_text and not o.delta_token_ids and o.finish_reason is None:
                    continue
                text = o.delta_text
                if body.echo and (i, o.index) not in echoed:
                    echoed.add((i, o.index))
                    text = (prompts[i][0] or (state.tokenizer.decode(prompts[i][1])
                                              if state.tokenizer else "")) + text
                key = (i, o.index)
                lp = _completion_logprobs(state, o.delta_token_ids, o.delta_logprobs,
                                          offsets.get(key, 0))
                offsets[key] = offsets.get(key, 0) + len(text)
                yield chunks.chunk(i * body.n + o.index, text, lp, o.finish_reason,
                                   o.stop_reason)
            if out.finished:
                timings[i].finished(len(prompts[i][1]), [o.finish_reason for o in out.outputs])
    except (EngineError, EngineDeadError, KVTransferFailed, RequestFailed) as e:
        yield _sse(_stream_error(e))
        yield "data: [DONE]\n\n"
        return
    if body.stream_options and body.stream_options.include_usage:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}})
    yield "data: [DONE]\n\n"


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, model: str, base_id: str,
                       created: int, rendered: Any, gen: AsyncIterator[RequestOutput],
                       hide_reasoning: bool = False) -> AsyncIterator[str]:
    def shown(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deltas a client sees (`reasoning.exclude`: none that only carry reasoning)."""
        if not hide_reasoning:
            return deltas
        return [d for d in map(without_reasoning, deltas) if d]

    timing = _Timing(state.metrics)
    completion_tokens = 0
    streams: dict[int, Any] = {}
    chat = state.chat
    assert chat is not None, "the chat endpoint answers 400 without a chat template"

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return _sse({"id": base_id, "object": "chat.completion.chunk", "created": created,
                     "model": model,
                     "choices": [{"index": index, "delta": delta, "logprobs": extra.get("logprobs"),
                                  "finish_reason": finish,
                                  **({"stop_reason": extra["stop_reason"]} if finish else {})}]})

    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    try:
        async for _, out in _merge([gen]):
            new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
            timing.tokens_arrived(new_tokens)
            completion_tokens += new_tokens
            for o in out.outputs:
                parser = streams.setdefault(o.index, chat.stream_parser(rendered.tools))
                lp = _chat_logprobs(state, o.delta_token_ids, o.delta_logprobs,
                                    body.top_logprobs or 0)
                for delta in shown(parser.feed(o.delta_token_ids, o.delta_text)):
                    yield chunk(o.index, delta, logprobs=lp)
                    lp = None
                if o.finish_reason is not None:
                    for delta in shown(parser.flush()):
                        yield chunk(o.index, delta)
                    yield chunk(o.index, {}, finish_reason(o.finish_reason, parser.made_calls),
                                stop_reason=o.stop_reason)
            if out.finished:
                timing.finished(len(rendered.prompt_ids), [o.finish_reason for o in out.outputs])
    except (EngineError, EngineDeadError, KVTransferFailed, RequestFailed) as e:
        yield _sse(_stream_error(e))
    else:
        if body.stream_options and body.stream_options.include_usage:
            prompt_tokens = len(rendered.prompt_ids)
            yield _sse({"id": base_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens,
                                  "completion_tokens": completion_tokens,
                                  "total_tokens": prompt_tokens + completion_tokens}})
    yield "data: [DONE]\n\n"
