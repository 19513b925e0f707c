"""The Responses API's routes: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`; `open_responses` gives an app its store and background
runner (`app.state.responses_store`, `app.state.background_responses`).

A request is prepared by kvrelay/server/response_request.py (`prepare`: input → chat →
prompt, on a prep worker), then answered one of three ways: whole (`answer_whole`),
streamed (`answer_streamed`; both kvrelay/server/responses.py), or in the background
(kvrelay/server/response_background.py); a request with MCP tools runs the server's tool
loop instead (kvrelay/server/mcp/). The store (`open_store`: SQLite or memory;
kvrelay/server/response_store.py, response_sqlite.py) is read off the event loop: a SQLite
read, and the JSON of a large response, take milliseconds.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse

from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import serving
from kvrelay.server.harmony_chat import calls_limited
from kvrelay.server.mcp import loop as mcp_loop
from kvrelay.server.mcp.setup import open_setup
from kvrelay.server.prep import INLINE_BYTES, PreparedRoute
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_background import BackgroundResponses, check_background
from kvrelay.server.response_request import Prepared, ResponsesRequest, prepare
from kvrelay.server.response_sqlite import open_store
from kvrelay.server.response_store import ResponseStore, owner_of
from kvrelay.server.responses import answer_streamed, answer_whole
from kvrelay.server.routes import server_state

SSE = "text/event-stream"
router = APIRouter(route_class=PreparedRoute)


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, "NotFoundError",
                       "response_id")


def _engine_request(state: serving.ServerState, p: Prepared) -> AsyncIterator[RequestOutput]:
    """The engine request of `p` (400 / 503 at once when it cannot be admitted)."""
    return calls_limited(state.engine.generate(p.response_id, p.rendered.prompt_ids, p.params,
                                               p.body.kv_transfer_params), p.tools, state.chat)


def open_responses(app: FastAPI, state: serving.ServerState) -> ResponseStore:
    """The app's Responses store (SQLite or memory, `--responses-store`) and its runner of
    background responses."""
    store = open_store(state.agent)
    app.state.responses_store = store
    app.state.background_responses = BackgroundResponses(state, store)
    return store


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses_store


def _background(request: Request) -> BackgroundResponses:
    return request.app.state.background_responses


def _owner(request: Request) -> str:
    return owner_of(request.headers, server_state(request).agent.responses_owner_header)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state, store, background = server_state(request), _store(request), _background(request)
    owner = _owner(request)
    kv = serving.kv_transfer_params(body.kv_transfer_params)
    if kv is not None and kv.do_remote_decode:
        body.background = None       # a proxy's prefill leg: answered at once, not stored
    check_background(body, store)
    # MCP servers checked and listed, approval responses matched (mcp/setup.py)
    mcp = await open_setup(body, state.agent, store, owner)
    # rendering, tokenising and the grammar check on a worker thread (server/prep.py);
    # always there: a text.format or a tool schema can take a while to check
    p = await state.prep.run(prepare, state, store, body, owner, mcp, size=INLINE_BYTES + 1)
    if body.background:           # (never a prefill leg: its background is cleared)
        return _start_background(state, background, p, mcp)
    if mcp is not None and not (kv is not None and kv.do_remote_decode):
        return await _mcp_answer(state, store, p, request, kv)
    serving.take_hold(state, request, kv)               # 429 before the engine holds
    if body.stream:
        # made before the response starts, so a full queue is a 503, not a broken stream
        try:
            gen = _engine_request(state, p)
        except OpenAIError:
            serving.refund_hold(state, request, kv)     # refused: it holds nothing
            raise
        return StreamingResponse(answer_streamed(state, store, p, gen), media_type=SSE)
    return await answer_whole(state, store, p, request)


def _start_background(state: serving.ServerState, background: BackgroundResponses,
                      p: Prepared, mcp: Any) -> Any:
    """Queue `p` as a background response: its queued body, or its event stream."""
    queued = background.start(p, lambda: _engine_request(state, p) if mcp is None
                              else mcp_loop.first_round(state, p))
    if p.body.stream:
        events = background.events(p.response_id, p.owner, None)
        assert events is not None, "a streamed run has its log from the start"
        return StreamingResponse(events, media_type=SSE)
    return queued


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = None) -> Any:
    owner = _owner(request)
    if stream:
        events = _background(request).events(response_id, owner, starting_after)
        if events is not None:
            return StreamingResponse(events, media_type=SSE)
    item = await asyncio.to_thread(_store(request).get, response_id, owner)
    if item is None:
        raise _not_found(response_id)
    if stream:
        raise OpenAIError("stream: only a background response created with stream: true "
                          "can be streamed again, while its events are kept (they are "
                          "not kept across a restart); GET it without stream",
                          param="stream")
    return item.body


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Any:
    owner = _owner(request)
    await _background(request).cancel(response_id, owner)
    item = await asyncio.to_thread(_store(request).get, response_id, owner)
    if item is None:
        raise _not_found(response_id)
    if not item.body.get("background"):
        raise OpenAIError("Cannot cancel a synchronous response.", param="response_id")
    return item.body        # cancelled now, or as it finished before (idempotent)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    owner, background = _owner(request), _background(request)
    await background.cancel(response_id, owner)    # else it would come back
    background.forget(response_id, owner)
    if not await asyncio.to_thread(_store(request).delete, response_id, owner):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def _mcp_answer(state: serving.ServerState, store: ResponseStore, p: Prepared,
                      request: Request, kv: Any) -> Any:
    """A response whose tools include MCP servers: the server runs the tool loop
    (kvrelay/server/mcp/loop.py). A proxy's prefill leg is answered as any other (it
    lists the tools, to render the same prompt, and calls none)."""
    serving.take_hold(state, request, kv)
    try:
        gen = mcp_loop.first_round(state, p)
    except OpenAIError:
        serving.refund_hold(state, request, kv)
        raise
    if p.body.stream:
        return StreamingResponse(mcp_loop.stream(state, store, p, gen), media_type=SSE)
    return await mcp_loop.create(state, store, p, gen, request)
