"""OpenAI's Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

A request becomes a chat conversation (`input` items → chat messages, `instructions` →
the system message, `reasoning.effort` → harmony's `Reasoning:` line) and is rendered by
the server's chat renderer, so harmony prompts are the same as on /v1/chat/completions.
The output tokens go through one `_OutputBuilder` for both the streamed and the whole
answer: each harmony message becomes an output item (analysis → `reasoning`, a call to
`functions.NAME` → `function_call`, any other text → `message`: `harmony_chat.delta_kind`,
as chat splits it), each with the streaming events the openai client parses.

Stored responses (`store`, default true) live in a bounded `ResponseStore`
(kvrelay/server/response_store.py: SQLite under the state directory or memory; entries,
bytes and one entry's size bounded, least recently used evicted first, each entry visible
only to the client that created it); `previous_response_id` continues one: its whole
conversation (inputs, outputs and function calls with their results, not its instructions)
comes before the new input. The routes are kvrelay/server/response_routes.py's;
`background: true` runs in kvrelay/server/response_background.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrelay import harmony
from kvrelay.engine.client import EngineDeadError, EngineError, KVTransferFailed
from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import serving, structured_hooks
from kvrelay.server.chat import Rendered
from kvrelay.server.harmony_chat import HarmonyChat, calls_limited, delta_kind
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError, ThinkingTokenBudget
from kvrelay.server.response_store import (
    ResponseStore,
    StoredResponse,
    check_metadata,
    previous_conversation,
)
from kvrelay.server.tools import ToolCallOut, ToolSpec, calls_from_json_array, tool_spec

logger = logging.getLogger(__name__)


class ResponsesRequest(BaseModel):
    """The request body; unknown fields are accepted and ignored (as on chat)."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    reasoning: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool | None = None
    seed: int | None = None            # vLLM's extension, as on chat
    thinking_token_budget: ThinkingTokenBudget = None   # vLLM's, as on chat (docs/agents.md)
    max_tool_calls: int | None = Field(None, ge=1)      # MCP calls this response may make
    # vLLM's disaggregation field, as on chat: the proxy's prefill leg asks for the KV to be
    # kept ({do_remote_decode: true}) and gets the handle back; its decode leg passes it in.
    kv_transfer_params: dict[str, Any] | None = None


# ------------------------------------------------------------------ input → chat messages

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}: expected a string or a list of content parts", param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise OpenAIError(f"{where}[{i}]: unsupported content part type {kind!r} (text only)",
                              param=where)
        parts.append(part.get("text", part.get("refusal")))
    return "".join(parts)


class _Conversation:
    """Builds chat messages from Responses items; consecutive assistant items (reasoning,
    text, calls) merge into one assistant message, as one harmony turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None    # the assistant message being assembled

    def _assistant(self) -> dict[str, Any]:
        if self._open is None:
            self._open = {"role": "assistant", "content": ""}
            self.messages.append(self._open)
        return self._open

    def _close(self) -> None:
        self._open = None

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, Mapping):
            raise OpenAIError(f"{where}: expected an input item object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            text = _text(item.get("content"), f"{where}.content") or \
                _text(item.get("summary"), f"{where}.summary")
            msg = self._assistant()
            if msg.get("content") or msg.get("tool_calls"):
                self._close()
                msg = self._assistant()
            msg["reasoning"] = (msg.get("reasoning") or "") + text
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            arguments = item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise OpenAIError(f"{where}: a function_call needs 'name' and 'call_id'",
                                  param=where)
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            self._assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}})
        elif kind in ("mcp_call", "mcp_list_tools"):
            self._mcp(item, kind, where)
        elif kind == "function_call_output":
            self._close()
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise OpenAIError(f"{where}.call_id: expected a string", param=where)
            self.messages.append({"role": "tool", "tool_call_id": call_id,
                                  "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise OpenAIError(f"{where}: unsupported input item type {kind!r} (supported: "
                              f"message, reasoning, function_call, function_call_output, "
                              f"mcp_list_tools, mcp_call)", param=where)

    def _mcp(self, item: Mapping[str, Any], kind: str, where: str) -> None:
        """An MCP call the server ran: the call, then its output (or error) as the tool's
        answer, as harmony shows a function call and its result. A tool list is no
        message (the tools are offered again with the request that continues)."""
        if kind == "mcp_list_tools":
            return
        name, call_id = item.get("name"), item.get("id")
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise OpenAIError(f"{where}: an mcp_call needs 'name' and 'id'", param=where)
        self.add({"type": "function_call", "name": name, "call_id": call_id,
                  "arguments": item.get("arguments") or "{}"}, where)
        output = item.get("output")
        if not isinstance(output, str):
            output = f"error: {json.dumps(item.get('error') or 'the call was not made')}"
        self.add({"type": "function_call_output", "call_id": call_id, "output": output}, where)

    def _message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise OpenAIError(f"{where}.role: expected user, system, developer or assistant, "
                              f"got {role!r}", param=where)
        text = _text(item.get("content"), f"{where}.content")
        if role != "assistant":
            self._close()
            self.messages.append({"role": role, "content": text})
            return
        msg = self._assistant()
        if msg.get("tool_calls"):            # text after a call starts a new turn
            self._close()
            msg = self._assistant()
        msg["content"] = (msg.get("content") or "") + text


def input_messages(raw: str | list[Any]) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) → chat messages (400 on what is unsupported)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    conv = _Conversation()
    for i, item in enumerate(raw):
        conv.add(item, f"input[{i}]")
    return conv.messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as chat messages (for `previous_response_id`)."""
    conv = _Conversation()
    for i, item in enumerate(output):
        conv.add(item, f"output[{i}]")
    return conv.messages


# ------------------------------------------------------------------ output items and events


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    kind: str                         # "reasoning" | "message" | "function_call"
    item: dict[str, Any]
    index: int
    text: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.item["id"]


class _OutputBuilder:
    """Output text → output items, and the streaming events that describe them (kept in
    `events` until taken). One harmony message is one item."""

    def __init__(self, tools: ToolSpec) -> None:
        self.tools = tools
        self.items: list[_Item] = []
        self.events: list[dict[str, Any]] = []
        self._current: _Item | None = None
        self._message_key: Any = None      # which harmony message the current item shows
        self._pending: list[str] = []      # required choice, template model: the JSON so far

    # -- input

    def harmony(self, delta: harmony.Delta) -> None:
        """A harmony delta: a call → a function_call item, analysis → a reasoning item,
        anything else the model wrote (final, preambles, other channels, malformed output)
        → a message item (`harmony_chat.delta_kind`)."""
        if not delta.text:
            return
        kind = delta_kind(delta, self.tools)
        if kind == "call":
            self._text("function_call", delta.message, delta.text, delta.call_name)
        else:
            self._text("reasoning" if kind == "reasoning" else "message", delta.message,
                       delta.text, None)

    def text(self, text: str) -> None:
        """A template model's output: its text, or under a forced choice the JSON list of
        calls (items when complete)."""
        if not text:
            return
        if self.tools.choice.forces_call:
            self._pending.append(text)
        else:
            self._text("message", 0, text, None)

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        pending = "".join(self._pending)
        if pending:
            calls = calls_from_json_array(pending)
            if calls is None:
                self._text("message", 0, pending, None)
            for i, call in enumerate(self.tools.limit(calls or [])):
                self._text("function_call", ("call", i), call.arguments, call.name)
        self._close(incomplete)
        return [it.item for it in self.items]

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    @property
    def made_calls(self) -> bool:
        return any(it.kind == "function_call" for it in self.items)

    # -- items

    def _text(self, kind: str, key: Any, text: str, name: str | None) -> None:
        if self._current is None or self._current.kind != kind or self._message_key != key:
            self._close(False)
            self._open(kind, name)
            self._message_key = key
        item = self._current
        assert item is not None
        item.text.append(text)
        base = {"item_id": item.id, "output_index": item.index}
        if kind == "reasoning":
            self.events.append({"type": "response.reasoning_text.delta", **base,
                                "content_index": 0, "delta": text})
        elif kind == "message":
            self.events.append({"type": "response.output_text.delta", **base,
                                "content_index": 0, "delta": text, "logprobs": []})
        else:
            self.events.append({"type": "response.function_call_arguments.delta", **base,
                                "delta": text})

    def _open(self, kind: str, name: str | None) -> None:
        item: dict[str, Any]
        part: dict[str, Any] | None
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "content": [],
                    "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            call = ToolCallOut(name or "", "")
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.id,
                    "name": call.name, "arguments": "", "status": "in_progress"}
            part = None
        current = _Item(kind, item, len(self.items))
        self.items.append(current)
        self._current = current
        self.events.append({"type": "response.output_item.added",
                            "output_index": current.index, "item": json.loads(json.dumps(item))})
        if part is not None:
            self.events.append({"type": "response.content_part.added", "item_id": current.id,
                                "output_index": current.index, "content_index": 0,
                                "part": part})

    def _close(self, incomplete: bool) -> None:
        item = self._current
        if item is None:
            return
        self._current = None
        text = "".join(item.text)
        base = {"item_id": item.id, "output_index": item.index}
        status = "incomplete" if incomplete else "completed"
        part: dict[str, Any] | None
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            self.events.append({"type": "response.reasoning_text.done", **base,
                                "content_index": 0, "text": text})
        elif item.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self.events.append({"type": "response.output_text.done", **base,
                                "content_index": 0, "text": text, "logprobs": []})
        else:
            part = None
            item.item["arguments"] = text
            self.events.append({"type": "response.function_call_arguments.done", **base,
                                "arguments": text, "name": item.item["name"]})
        if part is not None:
            item.item["content"] = [part]
            self.events.append({"type": "response.content_part.done", **base,
                                "content_index": 0, "part": part})
        item.item["status"] = status
        self.events.append({"type": "response.output_item.done", "output_index": item.index,
                            "item": json.loads(json.dumps(item.item))})


_MESSAGE_ENDS = (harmony.END_ID, harmony.RETURN_ID, harmony.CALL_ID)


class _Decoder:
    """Completion tokens → the builder: through harmony's parser, or as text."""

    def __init__(self, harmony_model: bool, builder: _OutputBuilder) -> None:
        self.builder = builder
        self.parser = harmony.HarmonyStreamParser() if harmony_model else None
        self.reasoning_tokens = 0

    def feed(self, token_ids: list[int], text: str) -> None:
        if self.parser is None:
            self.builder.text(text)
            return
        for token in token_ids:
            # the analysis message's text tokens (not its header or its <|end|>)
            if self.parser.content_channel == "analysis" and token not in _MESSAGE_ENDS:
                self.reasoning_tokens += 1
            for delta in self.parser.feed(token):
                self.builder.harmony(delta)

    def close(self) -> None:
        if self.parser is not None:
            for delta in self.parser.close():
                self.builder.harmony(delta)


# ------------------------------------------------------------------ one request


@dataclass
class _Prepared:
    body: ResponsesRequest
    model: str
    messages: list[dict[str, Any]]      # the conversation sent (without instructions)
    rendered: Rendered
    params: Any
    tools: ToolSpec
    owner: str = ""                     # owner_of(...): whose stored response this will be
    mcp: Any = None                     # kvrelay/server/mcp/setup.McpSetup (None: no MCP tools)
    response_id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def _effort(body: ResponsesRequest) -> str | None:
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and (not isinstance(effort, str)
                               or effort not in harmony.REASONING_EFFORTS):
        raise OpenAIError(f"reasoning.effort: expected one of "
                          f"{', '.join(harmony.REASONING_EFFORTS)}, got {effort!r}",
                          param="reasoning.effort")
    return effort


def _text_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` → a JSON schema to constrain the answer to (None: plain text)."""
    fmt = (body.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, Mapping):
        fmt = {"type": fmt}                       # reported below as a bad format
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), Mapping):
        return dict(fmt["schema"])
    raise OpenAIError("text.format: expected {'type': 'text'}, {'type': 'json_object'} or "
                      "{'type': 'json_schema', 'name': ..., 'schema': {...}}", param="text.format")


def _prepare(state: serving.ServerState, store: ResponseStore, body: ResponsesRequest,
             owner: str = "", mcp: Any = None) -> _Prepared:
    model = serving._check_model(state, body.model)
    check_metadata(body.metadata)
    if state.chat is None:
        raise OpenAIError("this model has no chat template", param="input")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        if not store.enabled:
            raise OpenAIError("previous_response_id needs the responses store, which is off "
                              "on this server (VLLM_ENABLE_RESPONSES_API_STORE=0)",
                              param="previous_response_id")
        previous = store.get(body.previous_response_id, owner)
        if previous is None:
            raise OpenAIError(f"Previous response with id '{body.previous_response_id}' not found.",
                              param="previous_response_id")
        history = previous_conversation(previous)
    messages = history + input_messages(body.input)
    if not messages:
        raise OpenAIError("input: expected at least one item", param="input")
    tools = mcp.tool_spec(body.parallel_tool_calls) if mcp is not None else \
        tool_spec(body.tools, body.tool_choice, body.parallel_tool_calls)
    rendered, params = _render(state, body, model, messages, tools, body.max_output_tokens)
    return _Prepared(body, model, messages, rendered, params, tools, owner, mcp=mcp)


def _render(state: serving.ServerState, body: ResponsesRequest, model: str,
            messages: list[dict[str, Any]], tools: ToolSpec, max_tokens: int | None,
            within_context: bool = False) -> tuple[Rendered, Any]:
    """The prompt and sampling params of `messages` (the conversation, without the
    instructions) under `body`'s settings. `within_context`: `max_tokens` is cut to the
    room the prompt leaves (a later round of the MCP tool loop) instead of a 400."""
    assert state.chat is not None          # _prepare checked it
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        chat = ChatCompletionRequest.model_validate({
            "model": model, "messages": system + messages, "reasoning_effort": _effort(body),
            "tools": [t.as_chat_tool() for t in tools.tools] or None,
            "tool_choice": _chat_choice(tools), "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p, "max_tokens": max_tokens, "seed": body.seed,
            "thinking_token_budget": body.thinking_token_budget})
    except ValidationError as e:    # an input the chat form cannot hold: the client's
        raise OpenAIError(f"input: {e.errors()[0].get('msg', 'invalid')}", param="input") from None
    rendered = state.chat.render(chat, state.max_model_len)
    schema = _text_format(body)
    if rendered.structured is None and schema is not None:
        rendered.structured = structured_hooks.json_format(
            schema, isinstance(state.chat, HarmonyChat), tools)
    if within_context and max_tokens is not None:
        max_tokens = min(max_tokens, max(state.max_model_len - len(rendered.prompt_ids), 1))
    max_tokens = serving._check_lengths(state, rendered.prompt_ids, max_tokens)
    params = structured_hooks.attach(
        serving._sampling(state, chat, max_tokens, None, extra_stop_ids=rendered.stop_token_ids),
        rendered.structured, body=chat)
    return rendered, params


def _chat_choice(tools: ToolSpec) -> Any:
    if tools.choice.mode == "named":
        return {"type": "function", "function": {"name": tools.choice.name}}
    return tools.choice.mode if tools.tools else None


def _response(p: _Prepared, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, store: bool) -> dict[str, Any]:
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
        "reasoning": {"effort": _effort(body) or "medium", "summary": None},
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": p.tools.choice.as_response_value() if p.mcp is None else
        p.mcp.choice_sent or p.tools.choice.as_response_value(),
        "tools": [t.as_response_tool() for t in p.tools.tools] if p.mcp is None else
        p.mcp.echo_tools(p.tools),
        "store": store, "truncation": "disabled", "user": body.user, "usage": usage,
        "background": bool(body.background),
    }


def _usage(p: _Prepared, output_tokens: int, reasoning_tokens: int,
           cached: int) -> dict[str, Any]:
    prompt = len(p.rendered.prompt_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + output_tokens}


def _finish(state: serving.ServerState, store: ResponseStore, p: _Prepared, decoder: _Decoder,
            final: RequestOutput) -> dict[str, Any]:
    out = final.outputs[0]
    decoder.close()
    incomplete = out.finish_reason == "length"
    output = decoder.builder.finish(incomplete)
    keep = bool(p.body.store) and store.enabled
    response = _response(p, "incomplete" if incomplete else "completed", output,
                         _usage(p, len(out.token_ids), decoder.reasoning_tokens,
                                final.num_cached_tokens), keep)
    if keep and not store.put(StoredResponse(response, p.messages + output_messages(output),
                                             p.owner)):
        response["store"] = False          # larger than one entry may be: answered, not kept
    return response


async def _create(state: serving.ServerState, store: ResponseStore, p: _Prepared,
                  request: Request) -> dict[str, Any]:
    gen = calls_limited(state.engine.generate(p.response_id, p.rendered.prompt_ids, p.params,
                                              p.body.kv_transfer_params), p.tools, state.chat)
    (final,) = await serving._until_disconnect(request, asyncio.ensure_future(
        serving._collect(state, [gen], [(None, p.rendered.prompt_ids)])))
    decoder = _Decoder(isinstance(state.chat, HarmonyChat), _OutputBuilder(p.tools))
    out = final.outputs[0]
    decoder.feed(out.token_ids, out.text)
    response = _finish(state, store, p, decoder, final)
    if p.body.kv_transfer_params:         # a prefill leg: the handle the decode leg needs
        response = {**response, "kv_transfer_params": final.kv_transfer_params}
    return response


def _event(seq: int, payload: dict[str, Any]) -> str:
    payload = {**payload, "sequence_number": seq}
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(state: serving.ServerState, store: ResponseStore, p: _Prepared,
                  gen: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    seq = 0
    decoder = _Decoder(isinstance(state.chat, HarmonyChat), _OutputBuilder(p.tools))
    start = _response(p, "in_progress", [], None, bool(p.body.store) and store.enabled)
    for kind in ("response.created", "response.in_progress"):
        yield _event(seq, {"type": kind, "response": start})
        seq += 1
    timing = serving._Timing(state.metrics)
    final = None
    try:
        async for _, out in serving._merge([gen]):
            o = out.outputs[0]
            timing.tokens_arrived(len(o.delta_token_ids))
            decoder.feed(o.delta_token_ids, o.delta_text)
            for event in decoder.builder.take_events():
                yield _event(seq, event)
                seq += 1
            if out.finished:
                final = out
                timing.finished(len(p.rendered.prompt_ids), [o.finish_reason])
    except (EngineError, EngineDeadError, KVTransferFailed) as e:
        yield _event(seq, {"type": "error", "code": type(e).__name__, "message": str(e),
                           "param": None})
        return
    if final is None:
        return
    response = _finish(state, store, p, decoder, final)
    for event in decoder.builder.take_events():
        yield _event(seq, event)
        seq += 1
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield _event(seq, {"type": kind, "response": response})
