"""The MCP tool loop of one response, whole or streamed.

    output: [mcp_list_tools per server]                      (setup.py, before the loop)
    round 1: generate (tool_choice as the request says)
       the model called MCP tools   → an `mcp_call` item each: called in order, each within
                                      the timeout; its output (or error) joins the item
       it called one of the request's own functions, or no tool at all → the response ends
    round 2, 3, ...: the conversation plus the calls and their results, rendered again,
       generated again (tool_choice auto: a forced call is forced once)
    ends: `completed` when the model answers; `incomplete` when max_output_tokens runs out
          over all rounds (reason `max_output_tokens`), the context is full (`max_model_len`)
          or the model asks for more calls than the response may make (--tool-server-max-calls,
          the request's `max_tool_calls`; reason `max_tool_calls`: the call is not made).

One round's output goes through responses.py's `_OutputBuilder` as any response's does;
`_Round` renames what it makes for MCP tools (a `function_call` item of an MCP tool becomes
an `mcp_call` item, its argument events `response.mcp_call_arguments.*`) and numbers the
items after those of earlier rounds. `usage` adds up every round (each is a model call:
its prompt, cached tokens, output and reasoning tokens).
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.client import EngineDeadError, EngineError, KVTransferFailed
from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import serving
from kvrelay.server.harmony_chat import HarmonyChat, calls_limited
from kvrelay.server.mcp.client import call_tool
from kvrelay.server.mcp.setup import McpSetup
from kvrelay.server.prep import INLINE_BYTES
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_store import ResponseStore, StoredResponse
from kvrelay.server.responses import (
    _Decoder,
    _event,
    _OutputBuilder,
    _Prepared,
    _render,
    _response,
    output_messages,
)
from kvrelay.server.tools import ToolChoice

STREAM_ERRORS = (EngineError, EngineDeadError, KVTransferFailed)


@dataclass
class _Usage:
    input: int = 0
    cached: int = 0
    output: int = 0
    reasoning: int = 0

    def add(self, prompt: int, final: RequestOutput, reasoning: int) -> None:
        self.input += prompt
        self.cached += final.num_cached_tokens
        self.output += len(final.outputs[0].token_ids)
        self.reasoning += reasoning

    def as_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input,
                "input_tokens_details": {"cached_tokens": self.cached, "cache_write_tokens": 0},
                "output_tokens": self.output,
                "output_tokens_details": {"reasoning_tokens": self.reasoning},
                "total_tokens": self.input + self.output}


class _Round:
    """One round's builder events and items, as the response shows them: output indexes
    after `offset`, calls of MCP tools as `mcp_call` items (whose `output_item.done` waits
    for the call)."""

    def __init__(self, offset: int, mcp: McpSetup) -> None:
        self.offset, self.mcp = offset, mcp
        self.calls: dict[str, dict[str, Any]] = {}      # builder item id → mcp_call item
        self.index: dict[str, int] = {}                 # mcp_call id → its output index

    def events(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for e in events:
            e = {**e, "output_index": e["output_index"] + self.offset}
            kind, item = e["type"], e.get("item") or {}
            if kind == "response.output_item.added" and self._is_mcp(item):
                e["item"] = dict(self._new_call(item, e["output_index"]))
            elif e.get("item_id") in self.calls:
                call = self.calls[e["item_id"]]
                e["item_id"] = call["id"]
                if kind == "response.function_call_arguments.delta":
                    e["type"] = "response.mcp_call_arguments.delta"
                elif kind == "response.function_call_arguments.done":
                    e = {k: v for k, v in e.items() if k != "name"}
                    e["type"] = "response.mcp_call_arguments.done"
                    call["arguments"] = e["arguments"]
            elif kind == "response.output_item.done" and item.get("id") in self.calls:
                if item.get("status") == "incomplete":      # cut by max_tokens: not called
                    self.calls[item["id"]]["status"] = "incomplete"
                continue
            out.append(e)
        return out

    def items(self, built: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.calls.get(it["id"], it) for it in built]

    def _is_mcp(self, item: dict[str, Any]) -> bool:
        return item.get("type") == "function_call" and self.mcp.server_of(item["name"]) is not None

    def _new_call(self, item: dict[str, Any], index: int) -> dict[str, Any]:
        server = self.mcp.server_of(item["name"])
        assert server is not None
        call = {"type": "mcp_call", "id": f"mcp_{uuid.uuid4().hex}",
                "server_label": server.label, "name": item["name"], "arguments": "",
                "output": None, "error": None, "status": "in_progress",
                "approval_request_id": None}
        self.calls[item["id"]] = call
        self.index[call["id"]] = index
        return call


@dataclass
class McpLoop:
    """Owner of one response's tool loop: its items so far, usage, calls made and status."""
    state: serving.ServerState
    store: ResponseStore
    p: _Prepared
    items: list[dict[str, Any]] = field(default_factory=list)
    usage: _Usage = field(default_factory=_Usage)
    calls_made: int = 0
    status: str = "completed"
    reason: str | None = None                  # incomplete_details.reason

    @property
    def mcp(self) -> McpSetup:
        return self.p.mcp

    async def run(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[dict[str, Any]]:
        """The response's events (without sequence numbers), round after round."""
        for i, item in enumerate(self.mcp.list_items):
            for e in _list_events(i, item):
                yield e
            self.items.append(item)
        rendered, tools = self.p.rendered, self.p.tools
        for round_no in range(self.mcp.max_calls + 1):
            r = _Round(len(self.items), self.mcp)
            decoder = _Decoder(isinstance(self.state.chat, HarmonyChat), _OutputBuilder(tools))
            final = None
            async for events, out in self._generate(gen, decoder, r):
                for e in events:
                    yield e
                final = out
            assert final is not None
            self.usage.add(len(rendered.prompt_ids), final, decoder.reasoning_tokens)
            built = r.items(decoder.builder.finish(final.outputs[0].finish_reason == "length"))
            for e in r.events(decoder.builder.take_events()):
                yield e
            self.items.extend(built)
            async for e in self._calls(r, built, final.outputs[0].finish_reason == "length"):
                yield e
            if not self._goes_on(built):
                return
            tools = dataclasses.replace(tools, choice=ToolChoice("auto"))
            nxt = await self._render(tools)
            if nxt is None:
                return
            rendered, params = nxt
            gen = calls_limited(self.state.engine.generate(
                f"{self.p.response_id}-{round_no + 1}", rendered.prompt_ids, params, None),
                tools, self.state.chat)

    def response(self) -> dict[str, Any]:
        """The finished response, stored unless `store: false`."""
        keep = bool(self.p.body.store) and self.store.enabled
        response = _response(self.p, self.status, self.items, self.usage.as_dict(), keep)
        if self.reason is not None:
            response["incomplete_details"] = {"reason": self.reason}
        messages = self.p.messages + output_messages(self.items)
        if keep and not self.store.put(StoredResponse(response, messages, self.p.owner)):
            response["store"] = False
        return response

    # -- one round

    async def _generate(self, gen: AsyncIterator[RequestOutput], decoder: _Decoder,
                        r: _Round) -> AsyncIterator[tuple[list[dict[str, Any]], RequestOutput]]:
        timing = serving._Timing(self.state.metrics)
        async for _, out in serving._merge([gen]):
            o = out.outputs[0]
            timing.tokens_arrived(len(o.delta_token_ids))
            decoder.feed(o.delta_token_ids, o.delta_text)
            if out.finished:
                decoder.close()
                timing.finished(len(out.prompt_token_ids or []), [o.finish_reason])
            yield r.events(decoder.builder.take_events()), out

    async def _calls(self, r: _Round, built: list[dict[str, Any]],
                     cut: bool) -> AsyncIterator[dict[str, Any]]:
        """Runs this round's MCP calls in order (none when the round was cut short)."""
        if cut:
            self._incomplete("max_output_tokens")
        for call in (it for it in built if it["type"] == "mcp_call"):
            index = r.index[call["id"]]
            base = {"item_id": call["id"], "output_index": index}
            if call["status"] == "in_progress" and self.status == "completed" \
                    and self.calls_made >= self.mcp.max_calls:
                call["error"] = {"type": "mcp_protocol_error", "code": 0, "message":
                                 f"not called: this response may make {self.mcp.max_calls} "
                                 f"MCP calls (max_tool_calls, --tool-server-max-calls)"}
                self._incomplete("max_tool_calls")
            if call["status"] != "in_progress" or self.status != "completed":
                call["status"] = "incomplete"
                yield {"type": "response.output_item.done", "output_index": index, "item": call}
                continue
            yield {"type": "response.mcp_call.in_progress", **base}
            await self._call(call)
            yield {"type": f"response.mcp_call.{call['status']}", **base}
            yield {"type": "response.output_item.done", "output_index": index, "item": call}

    async def _call(self, call: dict[str, Any]) -> None:
        server = self.mcp.server_of(call["name"])
        assert server is not None
        self.calls_made += 1
        outcome = await call_tool(server, call["name"], call["arguments"], self.mcp.timeout_s)
        call["output"], call["error"] = outcome.output, outcome.error
        call["status"] = "failed" if outcome.error is not None else "completed"

    def _goes_on(self, built: list[dict[str, Any]]) -> bool:
        """Another round: the model called MCP tools (all made), and none of the request's
        own functions (their results come from the client)."""
        kinds = {it["type"] for it in built}
        return self.status == "completed" and "mcp_call" in kinds and "function_call" not in kinds

    async def _render(self, tools: Any) -> tuple[Any, Any] | None:
        """The next round's prompt and params; None (incomplete) when no room is left."""
        limit = self.p.body.max_output_tokens
        left = None if limit is None else limit - self.usage.output
        if left is not None and left < 1:
            self._incomplete("max_output_tokens")
            return None
        messages = self.p.messages + output_messages(self.items)
        try:
            return await self.state.prep.run(_render, self.state, self.p.body, self.p.model,
                                             messages, tools, left, True, size=INLINE_BYTES + 1)
        except OpenAIError:
            self._incomplete("max_model_len")      # the conversation outgrew the context
            return None

    def _incomplete(self, reason: str) -> None:
        if self.status == "completed":
            self.status, self.reason = "incomplete", reason


def _list_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"item_id": item["id"], "output_index": index}
    outcome = "failed" if item["error"] is not None else "completed"
    return [{"type": "response.output_item.added", "output_index": index,
             "item": {**item, "tools": [], "error": None}},
            {"type": "response.mcp_list_tools.in_progress", **base},
            {"type": f"response.mcp_list_tools.{outcome}", **base},
            {"type": "response.output_item.done", "output_index": index, "item": item}]


# ------------------------------------------------------------------ the two answers


def first_round(state: serving.ServerState, p: _Prepared) -> AsyncIterator[RequestOutput]:
    """The first round's engine request (made before the answer starts: a full queue is a
    503, not a broken stream)."""
    return calls_limited(state.engine.generate(p.response_id, p.rendered.prompt_ids, p.params,
                                               p.body.kv_transfer_params), p.tools, state.chat)


async def create(state: serving.ServerState, store: ResponseStore, p: _Prepared,
                 gen: AsyncIterator[RequestOutput], request: Any) -> dict[str, Any]:
    """The whole response (the client leaving cancels it: the engine request is aborted)."""
    loop = McpLoop(state, store, p)

    async def drain() -> None:
        async for _ in loop.run(gen):
            pass
    try:
        await serving._until_disconnect(request, asyncio.ensure_future(drain()))
    except EngineError as e:
        raise OpenAIError(str(e), param=e.param) from None
    return loop.response()


async def stream(state: serving.ServerState, store: ResponseStore, p: _Prepared,
                 gen: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """The response as SSE events, `sequence_number` from 0."""
    start = _response(p, "in_progress", [], None, bool(p.body.store) and store.enabled)
    yield _event(0, {"type": "response.created", "response": start})
    yield _event(1, {"type": "response.in_progress", "response": start})
    seq = 2
    loop = McpLoop(state, store, p)
    try:
        async for payload in loop.run(gen):
            yield _event(seq, payload)
            seq += 1
    except (*STREAM_ERRORS, OpenAIError) as e:     # OpenAIError: a later round refused (503)
        yield _event(seq, {"type": "error", "code": type(e).__name__, "message": str(e),
                           "param": None})
        return
    response = loop.response()
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield _event(seq, {"type": kind, "response": response})
