"""The MCP tool loop of one response, whole, streamed or in the background.

    output: [mcp_list_tools per server]                      (setup.py, before the loop)
            [mcp_call per approved mcp_approval_response of the input: made first]
    round 1: generate (tool_choice as the request says)
       the model called MCP tools   → an `mcp_call` item each: called in order, each within
                                      the timeout; its output (or error) joins the item
       ... a tool whose server's require_approval asks → an `mcp_approval_request` item
                                      instead: not called; the response ends (`completed`)
       it called a built-in tool    → a `web_search_call` (browser.search / open / find) or
                                      `code_interpreter_call` (python) item, run on the
                                      --tool-server entry labelled browser / python
       it called one of the request's own functions, or no tool at all → the response ends
    round 2, 3, ...: the conversation plus the calls and their results, rendered again,
       generated again (tool_choice auto: a forced call is forced once)
    ends: `completed` when the model answers; `incomplete` when max_output_tokens runs out
          over all rounds (reason `max_output_tokens`), the context is full (`max_model_len`)
          or the model asks for more calls than the response may make (--tool-server-max-calls,
          the request's `max_tool_calls`; reason `max_tool_calls`: the call is not made).

One round's output goes through response_output.py's `OutputBuilder` as any response's does;
`_Round` renames what it makes for MCP tools (a `function_call` item of an MCP tool becomes
an `mcp_call` item, its argument events `response.mcp_call_arguments.*`; of a built-in, its
OpenAI item and events) and numbers the items after those of earlier rounds. `usage` adds up
every round (each is a model call: its prompt, cached tokens, output and reasoning tokens).
A tool's result reaches the model cut at --tool-server-max-output-bytes (mcp/client.py).
`McpLoop.stop` ends a loop that was cancelled (a background response): the round's items
closed `incomplete`, a call in flight abandoned (its session closed) and `incomplete`.
Disaggregated, round 1 of a decode leg uses the prefill's KV (`first_round`); when approved
calls come first, that KV is not round 1's prompt and is read at once instead
(`McpLoop._read_prefilled_kv`; `kvrelay proxy` sends such a request to no prefill).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.client import EngineDeadError, EngineError, KVTransferFailed
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams
from kvrelay.server import serving
from kvrelay.server.harmony_chat import HarmonyChat, calls_limited
from kvrelay.server.mcp.client import CallOutcome, call_tool
from kvrelay.server.mcp.setup import McpSetup
from kvrelay.server.prep import INLINE_BYTES
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_output import Decoder, OutputBuilder, new_id
from kvrelay.server.response_request import Prepared, output_messages, render_prompt
from kvrelay.server.response_store import ResponseStore, StoredResponse
from kvrelay.server.responses import response_object, sse_event
from kvrelay.server.tools import ToolChoice

STREAM_ERRORS = (EngineError, EngineDeadError, KVTransferFailed)
logger = logging.getLogger(__name__)


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
    for the call) or `mcp_approval_request` items, calls of built-in tools as
    `web_search_call` / `code_interpreter_call` items (waiting for the call too)."""

    def __init__(self, offset: int, mcp: McpSetup) -> None:
        self.offset, self.mcp = offset, mcp
        self.calls: dict[str, dict[str, Any]] = {}      # builder item id → the item shown
        self.index: dict[str, int] = {}                 # shown item id → its output index
        self.recipient: dict[str, str] = {}             # built-in item id → browser.search…
        self.arguments: dict[str, str] = {}             # built-in item id → as written

    def events(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            e = {**e, "output_index": e["output_index"] + self.offset}
            kind, item = e["type"], e.get("item") or {}
            if kind == "response.output_item.added" and self._runs(item):
                call = self._new_call(item, e["output_index"])
                e["item"] = dict(call)
                out.append(e)
                if call["type"] in BUILTIN_EVENTS:
                    out.append({"type": f"response.{BUILTIN_EVENTS[call['type']]}.in_progress",
                                "item_id": call["id"], "output_index": e["output_index"]})
                continue
            if e.get("item_id") in self.calls:
                shown = self._argument_event(e, self.calls[e["item_id"]])
                if shown is not None:
                    out.append(shown)
                continue
            if kind == "response.output_item.done" and item.get("id") in self.calls:
                call = self.calls[item["id"]]
                if call["type"] == "mcp_approval_request":      # asked, not called: done now
                    out.append({**e, "item": dict(call)})
                elif item.get("status") == "incomplete":       # cut by max_tokens: not called
                    call["status"] = "incomplete"
                continue
            out.append(e)
        return out

    def items(self, built: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.calls.get(it["id"], it) for it in built]

    def _runs(self, item: dict[str, Any]) -> bool:
        """A call the server makes (or asks about): of an MCP tool, or of a built-in."""
        return item.get("type") == "function_call" and (
            item["name"] in self.mcp.builtins or self.mcp.server_of(item["name"]) is not None)

    def _argument_event(self, e: dict[str, Any], call: dict[str, Any]) -> dict[str, Any] | None:
        """An argument event of a call, as its item's kind shows it (None: not shown)."""
        kind, base = e["type"], {"item_id": call["id"], "output_index": e["output_index"]}
        done = kind == "response.function_call_arguments.done"
        if done:
            self._arguments(call, e["arguments"])
        if call["type"] == "mcp_call":
            if done:
                return {"type": "response.mcp_call_arguments.done", **base,
                        "arguments": e["arguments"]}
            return {**e, **base, "type": "response.mcp_call_arguments.delta"}
        if call["type"] == "code_interpreter_call":
            if done:
                return {"type": "response.code_interpreter_call_code.done", **base,
                        "code": e["arguments"]}
            return {"type": "response.code_interpreter_call_code.delta", **base,
                    "delta": e["delta"]}
        return None              # an approval request, a web search: no argument events

    def _arguments(self, call: dict[str, Any], text: str) -> None:
        if call["type"] in ("mcp_call", "mcp_approval_request"):
            call["arguments"] = text
            return
        self.arguments[call["id"]] = text
        if call["type"] == "code_interpreter_call":
            call["code"] = text
        else:
            call["action"] = _web_action(self.recipient[call["id"]], text)

    def _new_call(self, item: dict[str, Any], index: int) -> dict[str, Any]:
        name = item["name"]
        call: dict[str, Any]
        if name in self.mcp.builtins:
            if name == "python":
                call = {"type": "code_interpreter_call", "id": new_id("ci"), "code": "",
                        "container_id": "auto", "outputs": None, "status": "in_progress"}
            else:
                call = {"type": "web_search_call", "id": new_id("ws"), "status": "in_progress",
                        "action": _web_action(name, "")}
            self.recipient[call["id"]] = name
        else:
            server = self.mcp.server_of(name)
            assert server is not None
            if self.mcp.asks(name):
                call = {"type": "mcp_approval_request", "id": new_id("mcpr"),
                        "server_label": server.label, "name": name, "arguments": ""}
            else:
                call = {"type": "mcp_call", "id": new_id("mcp"), "server_label": server.label,
                        "name": name, "arguments": "", "output": None, "error": None,
                        "status": "in_progress", "approval_request_id": None}
        self.calls[item["id"]] = call
        self.index[call["id"]] = index
        return call


# a built-in item's event prefix (`response.web_search_call.in_progress`, ...)
BUILTIN_EVENTS = {"web_search_call": "web_search_call",
                  "code_interpreter_call": "code_interpreter_call"}
CALLS = ("mcp_call", "web_search_call", "code_interpreter_call")    # items the loop runs


def _web_action(recipient: str, arguments: str) -> dict[str, Any]:
    """A `web_search_call`'s `action` from the browser call's JSON arguments."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        args = {}
    if not isinstance(args, dict):
        args = {}
    page = args.get("id")
    cursor = args.get("cursor")
    if recipient == "browser.open":
        return {"type": "open_page", "url": page if isinstance(page, str) else None}
    if recipient == "browser.find":
        return {"type": "find_in_page", "pattern": str(args.get("pattern") or ""),
                "url": f"cursor:{cursor}" if isinstance(cursor, int) else ""}
    query = args.get("query")
    return {"type": "search", "query": query if isinstance(query, str) else None}


@dataclass
class McpLoop:
    """Owner of one response's tool loop: its items so far, usage, calls made and status."""
    state: serving.ServerState
    store: ResponseStore
    p: Prepared
    items: list[dict[str, Any]] = field(default_factory=list)
    usage: _Usage = field(default_factory=_Usage)
    calls_made: int = 0
    status: str = "completed"
    reason: str | None = None                  # incomplete_details.reason
    # built-in item id → {recipient, arguments, output}: what the conversation shows of it
    # (the item itself holds neither the arguments as written nor the page read)
    hidden: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the round being generated: its builder, prompt length and last output (for stop())
    _live: tuple[_Round, Decoder, int] | None = None
    _last: RequestOutput | None = None

    @property
    def mcp(self) -> McpSetup:
        return self.p.mcp

    async def run(self, gen: AsyncIterator[RequestOutput] | None
                  ) -> AsyncIterator[dict[str, Any]]:
        """The response's events (without sequence numbers), round after round. `gen`: the
        first round's engine request (None: rendered here, after the approved calls)."""
        read = self._read_prefilled_kv() if gen is None else None
        try:
            for i, item in enumerate(self.mcp.list_items):
                for e in _list_events(i, item):
                    yield e
                self.items.append(item)
            async for e in self._approved():
                yield e
            if read is not None:
                await asyncio.wait([read])     # its blocks can serve the first round's prefix
        finally:
            if read is not None:
                read.cancel()                  # (finished by now, unless the loop was stopped)
        rendered_len, tools = len(self.p.rendered.prompt_ids), self.p.tools
        for round_no in range(self.mcp.max_calls + 1):
            if gen is None:
                nxt = await self._render(tools)
                if nxt is None:
                    return
                rendered, params = nxt
                rendered_len = len(rendered.prompt_ids)
                gen = calls_limited(self.state.engine.generate(
                    f"{self.p.response_id}-{round_no}", rendered.prompt_ids, params, None),
                    tools, self.state.chat)
            r = _Round(len(self.items), self.mcp)
            decoder = Decoder(isinstance(self.state.chat, HarmonyChat), OutputBuilder(tools))
            self._live, self._last = (r, decoder, rendered_len), None
            final = None
            async for events, out in self._generate(gen, decoder, r):
                for e in events:
                    yield e
                final = out
            assert final is not None
            self._live = None
            self.usage.add(rendered_len, final, decoder.reasoning_tokens)
            built = r.items(decoder.builder.finish(final.outputs[0].finish_reason == "length"))
            for e in r.events(decoder.builder.take_events()):
                yield e
            self.items.extend(built)
            async for e in self._calls(r, built, final.outputs[0].finish_reason == "length"):
                yield e
            if not self._goes_on(built):
                return
            tools = dataclasses.replace(tools, choice=ToolChoice("auto"))
            gen = None

    def response(self) -> dict[str, Any]:
        """The finished response, stored unless `store: false`."""
        keep = bool(self.p.body.store) and self.store.enabled
        response, messages = self.finish(keep)
        if keep and not self.store.put(StoredResponse(response, messages, self.p.owner)):
            response["store"] = False
        return response

    def finish(self, keep: bool, status: str | None = None,
               error: dict[str, Any] | None = None) -> tuple[dict[str, Any],
                                                                 list[dict[str, Any]]]:
        """The response as it stands (`status` / `error`: a run that was stopped) and the
        conversation through it (not stored)."""
        response = response_object(self.p, status or self.status, self.items, self.usage.as_dict(),
                             keep)
        if status is None and self.reason is not None:
            response["incomplete_details"] = {"reason": self.reason}
        if status is not None:
            response["incomplete_details"] = None
            response["error"] = error
        return response, self.conversation()

    def conversation(self) -> list[dict[str, Any]]:
        """The request's conversation and this response's output, as chat messages."""
        shown = [{"type": "builtin_call", "id": it["id"], **self.hidden[it["id"]]}
                 if it["id"] in self.hidden else it for it in self.items]
        return self.p.messages + output_messages(shown)

    def stop(self) -> list[dict[str, Any]]:
        """A loop that was cancelled: the round being generated closed `incomplete` (its
        tokens counted), a call in flight `incomplete` (abandoned); its last events."""
        events: list[dict[str, Any]] = []
        if self._live is not None:
            r, decoder, prompt = self._live
            self._live = None
            decoder.close()
            built = r.items(decoder.builder.finish(True))
            events = r.events(decoder.builder.take_events())
            if self._last is not None:
                self.usage.add(prompt, self._last, decoder.reasoning_tokens)
            else:
                self.usage.input += prompt
            self.items.extend(built)
        for item in self.items:
            if item["type"] in CALLS and item["status"] in ("in_progress", "searching",
                                                            "interpreting"):
                item["status"] = "incomplete"
                if item["id"] in self.hidden:
                    self.hidden[item["id"]]["output"] = "the call was cancelled"
        return events

    # -- one round

    async def _generate(self, gen: AsyncIterator[RequestOutput], decoder: Decoder,
                        r: _Round) -> AsyncIterator[tuple[list[dict[str, Any]], RequestOutput]]:
        timing = serving._Timing(self.state.metrics)
        async for _, out in serving._merge([gen]):
            o = out.outputs[0]
            self._last = out
            timing.tokens_arrived(len(o.delta_token_ids))
            decoder.feed(o.delta_token_ids, o.delta_text)
            if out.finished:
                decoder.close()
                timing.finished(len(out.prompt_token_ids or []), [o.finish_reason])
            yield r.events(decoder.builder.take_events()), out

    def _read_prefilled_kv(self) -> asyncio.Task[None] | None:
        """A decode leg whose first round comes after approved calls: that round's prompt
        holds their results, so the prefill's KV of the request's own prompt (which a proxy
        that sends every request through a prefill has it compute; `kvrelay proxy` sends
        such a request straight to decode) is not that round's. It is read anyway, at once,
        by a one-token engine request whose output is dropped: the prefill lets its blocks
        go now, not at its lease, and they stay in this server's prefix cache, where the
        first round finds the prompt they share. A failure is only logged: the loop goes on
        as without them. None when there is nothing to read."""
        raw = self.p.body.kv_transfer_params
        kv = serving.kv_transfer_params(raw)
        if kv is None or not kv.do_remote_prefill:
            return None
        engine, request_id = self.state.engine, f"{self.p.response_id}-kv"
        prompt, params = self.p.rendered.prompt_ids, SamplingParams(max_tokens=1,
                                                                    temperature=0.0)

        async def read() -> None:
            try:
                async for _ in engine.generate(request_id, prompt, params, raw):
                    pass
            except (OpenAIError, RuntimeError) as e:
                logger.warning("response %s: the prefilled KV of its prompt could not be read "
                               "(the prefill frees it at its lease): %s", self.p.response_id, e)
        return asyncio.ensure_future(read())

    async def _approved(self) -> AsyncIterator[dict[str, Any]]:
        """The calls the input approved (mcp_approval_response, approve true), made first."""
        for approval in self.mcp.approvals:
            if not approval.approve:
                continue
            req = approval.request
            index = len(self.items)
            call = {"type": "mcp_call", "id": new_id("mcp"), "server_label": req["server_label"],
                    "name": req["name"], "arguments": req.get("arguments") or "",
                    "output": None, "error": None, "status": "in_progress",
                    "approval_request_id": req["id"]}
            self.items.append(call)
            yield {"type": "response.output_item.added", "output_index": index,
                   "item": dict(call)}
            r = _Round(0, self.mcp)
            r.index[call["id"]] = index
            async for e in self._calls(r, [call], False):
                yield e

    async def _calls(self, r: _Round, built: list[dict[str, Any]],
                     cut: bool) -> AsyncIterator[dict[str, Any]]:
        """Runs this round's calls in order (none when the round was cut short)."""
        if cut:
            self._incomplete("max_output_tokens")
        for call in (it for it in built if it["type"] in CALLS):
            index = r.index[call["id"]]
            base = {"item_id": call["id"], "output_index": index}
            if call["status"] == "in_progress" and self.status == "completed" \
                    and self.calls_made >= self.mcp.max_calls:
                self._not_called(r, call, f"not called: this response may make "
                                          f"{self.mcp.max_calls} tool calls (max_tool_calls, "
                                          f"--tool-server-max-calls)")
                self._incomplete("max_tool_calls")
            if call["status"] != "in_progress" or self.status != "completed":
                call["status"] = "incomplete"
                if call["type"] != "mcp_call":
                    self._not_called(r, call, "not called: the response ended first")
                yield {"type": "response.output_item.done", "output_index": index, "item": call}
                continue
            if call["type"] == "mcp_call":
                yield {"type": "response.mcp_call.in_progress", **base}
                await self._call(call)
                yield {"type": f"response.mcp_call.{call['status']}", **base}
            else:
                prefix = f"response.{BUILTIN_EVENTS[call['type']]}"
                running = "searching" if call["type"] == "web_search_call" else "interpreting"
                yield {"type": f"{prefix}.{running}", **base}
                await self._call_builtin(r, call)
                if call["status"] == "completed":
                    yield {"type": f"{prefix}.completed", **base}
            yield {"type": "response.output_item.done", "output_index": index, "item": call}

    def _not_called(self, r: _Round, call: dict[str, Any], why: str) -> None:
        if call["type"] == "mcp_call":
            call["error"] = {"type": "mcp_protocol_error", "code": 0, "message": why}
        else:
            self.hidden[call["id"]] = {"recipient": r.recipient[call["id"]],
                                       "arguments": r.arguments.get(call["id"], ""),
                                       "output": why}

    async def _call(self, call: dict[str, Any]) -> None:
        server = self.mcp.server_of(call["name"])
        assert server is not None
        self.calls_made += 1
        outcome = await call_tool(server, call["name"], call["arguments"], self.mcp.timeout_s,
                                  self.mcp.max_output_bytes)
        call["output"], call["error"] = outcome.output, outcome.error
        call["status"] = "failed" if outcome.error is not None else "completed"

    async def _call_builtin(self, r: _Round, call: dict[str, Any]) -> None:
        recipient = r.recipient[call["id"]]
        arguments = r.arguments.get(call["id"], "")
        builtin = self.mcp.builtins[recipient]
        self.calls_made += 1
        hidden = self.hidden[call["id"]] = {"recipient": recipient, "arguments": arguments,
                                            "output": "the call was cancelled"}
        outcome = await call_tool(builtin.server, builtin.tool, arguments, self.mcp.timeout_s,
                                  self.mcp.max_output_bytes, builtin.code_key)
        hidden["output"] = text = _seen(outcome)
        call["status"] = "failed" if outcome.error is not None else "completed"
        if call["type"] == "code_interpreter_call":
            call["outputs"] = [{"type": "logs", "logs": text}]

    def _goes_on(self, built: list[dict[str, Any]]) -> bool:
        """Another round: the model called tools the server runs (all made), none of the
        request's own functions (their results come from the client) and none that waits
        for an approval."""
        kinds = {it["type"] for it in built}
        return self.status == "completed" and bool(kinds & set(CALLS)) \
            and not kinds & {"function_call", "mcp_approval_request"}

    async def _render(self, tools: Any) -> tuple[Any, Any] | None:
        """The next round's prompt and params; None (incomplete) when no room is left."""
        limit = self.p.body.max_output_tokens
        left = None if limit is None else limit - self.usage.output
        if left is not None and left < 1:
            self._incomplete("max_output_tokens")
            return None
        try:
            return await self.state.prep.run(render_prompt, self.state, self.p.body, self.p.model,
                                             self.conversation(), tools, left, True,
                                             size=INLINE_BYTES + 1)
        except OpenAIError:
            self._incomplete("max_model_len")      # the conversation outgrew the context
            return None

    def _incomplete(self, reason: str) -> None:
        if self.status == "completed":
            self.status, self.reason = "incomplete", reason


def _seen(outcome: CallOutcome) -> str:
    """A built-in call's result as the model reads it: the output, or the error."""
    if outcome.output is not None:
        return outcome.output
    return f"error: {json.dumps(outcome.error, ensure_ascii=False)}"


def _list_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"item_id": item["id"], "output_index": index}
    outcome = "failed" if item["error"] is not None else "completed"
    return [{"type": "response.output_item.added", "output_index": index,
             "item": {**item, "tools": [], "error": None}},
            {"type": "response.mcp_list_tools.in_progress", **base},
            {"type": f"response.mcp_list_tools.{outcome}", **base},
            {"type": "response.output_item.done", "output_index": index, "item": item}]


# ------------------------------------------------------------------ the two answers


def first_round(state: serving.ServerState,
                p: Prepared) -> AsyncIterator[RequestOutput] | None:
    """The first round's engine request (made before the answer starts: a full queue is a
    503, not a broken stream); None when approved calls come first (their results are in
    the first round's prompt: the loop renders it after them)."""
    if any(a.approve for a in p.mcp.approvals):
        return None
    return calls_limited(state.engine.generate(p.response_id, p.rendered.prompt_ids, p.params,
                                               p.body.kv_transfer_params), p.tools, state.chat)


async def create(state: serving.ServerState, store: ResponseStore, p: Prepared,
                 gen: AsyncIterator[RequestOutput] | None, request: Any) -> dict[str, Any]:
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


async def stream(state: serving.ServerState, store: ResponseStore, p: Prepared,
                 gen: AsyncIterator[RequestOutput] | None) -> AsyncIterator[str]:
    """The response as SSE events, `sequence_number` from 0."""
    start = response_object(p, "in_progress", [], None, bool(p.body.store) and store.enabled)
    yield sse_event(0, {"type": "response.created", "response": start})
    yield sse_event(1, {"type": "response.in_progress", "response": start})
    seq = 2
    loop = McpLoop(state, store, p)
    try:
        async for payload in loop.run(gen):
            yield sse_event(seq, payload)
            seq += 1
    except (*STREAM_ERRORS, OpenAIError) as e:     # OpenAIError: a later round refused (503)
        yield sse_event(seq, {"type": "error", "code": type(e).__name__, "message": str(e),
                           "param": None})
        return
    response = loop.response()
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield sse_event(seq, {"type": kind, "response": response})
