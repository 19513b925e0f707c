"""The Responses API's routes: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`.

A request is prepared by kvrelay/server/responses.py (`_prepare`: input → chat → prompt,
on a prep worker), then answered one of three ways: whole (`_create`), streamed
(`_stream`), or in the background (kvrelay/server/response_background.py); a request with
MCP tools runs the server's tool loop instead (kvrelay/server/mcp/). The store
(`open_store`: SQLite or memory; kvrelay/server/response_store.py, response_sqlite.py) is
read off the event loop: a SQLite read, and the JSON of a large response, take milliseconds.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import serving
from kvrelay.server.harmony_chat import calls_limited
from kvrelay.server.mcp import loop as mcp_loop
from kvrelay.server.mcp.setup import open_setup
from kvrelay.server.prep import INLINE_BYTES
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_background import BackgroundResponses, check_background
from kvrelay.server.response_sqlite import open_store
from kvrelay.server.response_store import ResponseStore, owner_of
from kvrelay.server.responses import ResponsesRequest, _create, _prepare, _Prepared, _stream

SSE = "text/event-stream"


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, "NotFoundError",
                       "response_id")


def _engine_request(state: serving.ServerState, p: _Prepared) -> AsyncIterator[RequestOutput]:
    """The engine request of `p` (400 / 503 at once when it cannot be admitted)."""
    return calls_limited(state.engine.generate(p.response_id, p.rendered.prompt_ids, p.params,
                                               p.body.kv_transfer_params), p.tools, state.chat)


def add_responses_routes(app: FastAPI, state: serving.ServerState) -> ResponseStore:
    agent = state.agent
    store = open_store(agent)
    background = BackgroundResponses(state, store)
    app.state.responses_store = store
    app.state.background_responses = background

    def owner(request: Request) -> str:
        return owner_of(request.headers, agent.responses_owner_header)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        kv = serving.kv_transfer_params(body.kv_transfer_params)
        if kv is not None and kv.do_remote_decode:
            body.background = None       # a proxy's prefill leg: answered at once, not stored
        check_background(body, store)
        mcp = await open_setup(body, agent)      # MCP servers checked and listed (mcp/setup.py)
        # rendering, tokenising and the grammar check on a worker thread (server/prep.py);
        # always there: a text.format or a tool schema can take a while to check
        p = await state.prep.run(_prepare, state, store, body, owner(request), mcp,
                                 size=INLINE_BYTES + 1)
        if mcp is not None and not (kv is not None and kv.do_remote_decode):
            return await _mcp_answer(state, store, p, request, kv)
        if body.background:
            queued = background.start(p, lambda: _engine_request(state, p))
            if body.stream:
                events = background.events(p.response_id, p.owner, None)
                assert events is not None, "a streamed run has its log from the start"
                return StreamingResponse(events, media_type=SSE)
            return queued
        serving.take_hold(state, request, kv)               # 429 before the engine holds
        if body.stream:
            # made before the response starts, so a full queue is a 503, not a broken stream
            try:
                gen = _engine_request(state, p)
            except OpenAIError:
                serving.refund_hold(state, request, kv)     # refused: it holds nothing
                raise
            return StreamingResponse(_stream(state, store, p, gen), media_type=SSE)
        return await _create(state, store, p, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request, stream: bool = False,
                           starting_after: int | None = None):
        if stream:
            events = background.events(response_id, owner(request), starting_after)
            if events is not None:
                return StreamingResponse(events, media_type=SSE)
        item = await asyncio.to_thread(store.get, response_id, owner(request))
        if item is None:
            raise _not_found(response_id)
        if stream:
            raise OpenAIError("stream: only a background response created with stream: true "
                              "can be streamed again, while its events are kept (they are "
                              "not kept across a restart); GET it without stream",
                              param="stream")
        return item.body

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        await background.cancel(response_id, owner(request))
        item = await asyncio.to_thread(store.get, response_id, owner(request))
        if item is None:
            raise _not_found(response_id)
        if not item.body.get("background"):
            raise OpenAIError("Cannot cancel a synchronous response.", param="response_id")
        return item.body        # cancelled now, or as it finished before (idempotent)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        await background.cancel(response_id, owner(request))    # else it would come back
        background.forget(response_id, owner(request))
        if not await asyncio.to_thread(store.delete, response_id, owner(request)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return store


async def _mcp_answer(state: serving.ServerState, store: ResponseStore, p: _Prepared,
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
