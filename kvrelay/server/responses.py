"""OpenAI's Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

A request is prepared by kvrelay/server/response_request.py (`prepare`: `input` items →
chat messages → the prompt, as on /v1/chat/completions) and answered here, whole
(`answer_whole`) or streamed (`answer_streamed`: server-sent events, `sse_event`). The
output tokens go through one `OutputBuilder` (kvrelay/server/response_output.py) for both:
each harmony message becomes an output item (analysis → `reasoning`, a call to
`functions.NAME` → `function_call`, any other text → `message`), each with the streaming
events the openai client parses; `response_object` is the Response JSON around them.

Stored responses (`store`, default true) live in a bounded `ResponseStore`
(kvrelay/server/response_store.py: SQLite under the state directory or memory; entries,
bytes and one entry's size bounded, least recently used evicted first, each entry visible
only to the client that created it); `previous_response_id` continues one: its whole
conversation (inputs, outputs and function calls with their results, not its instructions)
comes before the new input. The routes are kvrelay/server/routes/responses.py's;
`background: true` runs in kvrelay/server/response_background.py, MCP tools in
kvrelay/server/mcp/loop.py.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kvrelay.engine.client import EngineDeadError, EngineError, KVTransferFailed
from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import serving
from kvrelay.server.harmony_chat import HarmonyChat, calls_limited
from kvrelay.server.response_output import Decoder, OutputBuilder
from kvrelay.server.response_request import Prepared, output_messages, reasoning_effort
from kvrelay.server.response_store import ResponseStore, StoredResponse


def response_object(p: Prepared, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, store: bool) -> dict[str, Any]:
    """The Response JSON of `p` in `status` (`store`: whether it is kept)."""
    body = p.body
    return {
        "id": p.response_id, "object": "response", "created_at": p.created_at,
        "status": status, "model": p.model, "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None
        else True,
        "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning_effort(body) or "medium", "summary": None},
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": p.tools.choice.as_response_value() if p.mcp is None else
        p.mcp.choice_sent or p.tools.choice.as_response_value(),
        "tools": [t.as_response_tool() for t in p.tools.tools] if p.mcp is None else
        p.mcp.echo_tools(p.tools),
        "store": store, "truncation": "disabled", "user": body.user, "usage": usage,
        "background": bool(body.background),
    }


def response_usage(p: Prepared, output_tokens: int, reasoning_tokens: int,
                   cached: int) -> dict[str, Any]:
    prompt = len(p.rendered.prompt_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + output_tokens}


def finish_response(state: serving.ServerState, store: ResponseStore, p: Prepared,
                    decoder: Decoder, final: RequestOutput) -> dict[str, Any]:
    """The finished response (completed, or incomplete at max_output_tokens), stored when
    asked and the store is on."""
    out = final.outputs[0]
    decoder.close()
    incomplete = out.finish_reason == "length"
    output = decoder.builder.finish(incomplete)
    keep = bool(p.body.store) and store.enabled
    response = response_object(p, "incomplete" if incomplete else "completed", output,
                               response_usage(p, len(out.token_ids), decoder.reasoning_tokens,
                                              final.num_cached_tokens), keep)
    if keep and not store.put(StoredResponse(response, p.messages + output_messages(output),
                                             p.owner)):
        response["store"] = False          # larger than one entry may be: answered, not kept
    return response


async def answer_whole(state: serving.ServerState, store: ResponseStore, p: Prepared,
                       request: Request) -> dict[str, Any]:
    """`p` answered whole, once the engine has finished it."""
    gen = calls_limited(state.engine.generate(p.response_id, p.rendered.prompt_ids, p.params,
                                              p.body.kv_transfer_params), p.tools, state.chat)
    (final,) = await serving._until_disconnect(request, asyncio.ensure_future(
        serving._collect(state, [gen], [(None, p.rendered.prompt_ids)])))
    decoder = Decoder(isinstance(state.chat, HarmonyChat), OutputBuilder(p.tools))
    out = final.outputs[0]
    decoder.feed(out.token_ids, out.text)
    response = finish_response(state, store, p, decoder, final)
    if p.body.kv_transfer_params:         # a prefill leg: the handle the decode leg needs
        response = {**response, "kv_transfer_params": final.kv_transfer_params}
    return response


def sse_event(seq: int, payload: dict[str, Any]) -> str:
    """One server-sent event, numbered `seq` (`sequence_number`)."""
    payload = {**payload, "sequence_number": seq}
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def answer_streamed(state: serving.ServerState, store: ResponseStore, p: Prepared,
                          gen: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """`p` answered as server-sent events, from the engine request `gen`."""
    seq = 0
    decoder = Decoder(isinstance(state.chat, HarmonyChat), OutputBuilder(p.tools))
    start = response_object(p, "in_progress", [], None, bool(p.body.store) and store.enabled)
    for kind in ("response.created", "response.in_progress"):
        yield sse_event(seq, {"type": kind, "response": start})
        seq += 1
    timing = serving._Timing(state.metrics)
    final = None
    try:
        async for _, out in serving._merge([gen]):
            o = out.outputs[0]
            timing.tokens_arrived(len(o.delta_token_ids))
            decoder.feed(o.delta_token_ids, o.delta_text)
            for event in decoder.builder.take_events():
                yield sse_event(seq, event)
                seq += 1
            if out.finished:
                final = out
                timing.finished(len(p.rendered.prompt_ids), [o.finish_reason])
    except (EngineError, EngineDeadError, KVTransferFailed) as e:
        yield sse_event(seq, {"type": "error", "code": type(e).__name__, "message": str(e),
                              "param": None})
        return
    if final is None:
        return
    response = finish_response(state, store, p, decoder, final)
    for event in decoder.builder.take_events():
        yield sse_event(seq, event)
        seq += 1
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield sse_event(seq, {"type": kind, "response": response})
