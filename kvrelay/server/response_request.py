"""A Responses request: its body (`ResponsesRequest`), its input as chat messages, and its
prompt (`prepare` → `Prepared`).

A request becomes a chat conversation (`input` items → chat messages, `instructions` →
the system message, `reasoning.effort` → harmony's `Reasoning:` line) and is rendered by
the server's chat renderer, so harmony prompts are the same as on /v1/chat/completions.
Consecutive assistant items (reasoning, text, calls) merge into one assistant message,
as one harmony turn; `previous_response_id` puts the stored response's conversation first.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrelay import harmony
from kvrelay.server import serving, structured_hooks
from kvrelay.server.chat import Rendered
from kvrelay.server.harmony_chat import HarmonyChat
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError, ThinkingTokenBudget
from kvrelay.server.response_output import new_id
from kvrelay.server.response_store import ResponseStore, check_metadata, previous_conversation
from kvrelay.server.tools import ToolSpec, tool_spec


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

# items that are no chat message: a tool list (the tools are offered again with the request
# that continues); an approval request (its call is shown by the mcp_call that answers it, an
# unanswered one is left out); a web search (the page it read is not in the item)
_NO_MESSAGE = ("mcp_list_tools", "mcp_approval_request", "web_search_call")
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

    def __init__(self, approvals: Mapping[str, Any] | None = None,
                 internal: bool = False) -> None:
        self.messages: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None    # the assistant message being assembled
        # mcp_approval_response items: approval_request_id → what stands in the conversation
        # for the answered call (a declined call: an mcp_call whose error says so; None: the
        # call was approved and is shown by the response's mcp_call item). None: no MCP
        # tools in the request, so an approval response is a 400.
        self._approvals = approvals
        self._internal = internal     # a response's own output (built-in calls' records)

    def _assistant(self) -> dict[str, Any]:
        if self._open is None:
            self._open = {"role": "assistant", "content": ""}
            self.messages.append(self._open)
        return self._open

    def _close(self) -> None:
        self._open = None

    def add(self, item: Any, where: str) -> None:
        """One Responses item (`where`: its place, for errors; 400 on what is unsupported)."""
        if not isinstance(item, Mapping):
            raise OpenAIError(f"{where}: expected an input item object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind == "function_call":
            self._function_call(item, where)
        elif kind == "function_call_output":
            self._call_output(item, where)
        elif kind == "mcp_call":
            self._mcp(item, where)
        elif kind == "mcp_approval_response":
            self._approval(item, where)
        elif kind == "code_interpreter_call":
            self._code_interpreter(item, where)
        elif kind == "builtin_call" and self._internal:    # the MCP loop's record of a call
            self._builtin(item, where)
        elif kind not in _NO_MESSAGE:
            raise OpenAIError(f"{where}: unsupported input item type {kind!r} (supported: "
                              f"message, reasoning, function_call, function_call_output, "
                              f"mcp_list_tools, mcp_call, mcp_approval_request, "
                              f"mcp_approval_response, web_search_call, "
                              f"code_interpreter_call)", param=where)

    def _reasoning(self, item: Mapping[str, Any], where: str) -> None:
        text = _text(item.get("content"), f"{where}.content") or \
            _text(item.get("summary"), f"{where}.summary")
        msg = self._assistant()
        if msg.get("content") or msg.get("tool_calls"):
            self._close()
            msg = self._assistant()
        msg["reasoning"] = (msg.get("reasoning") or "") + text

    def _function_call(self, item: Mapping[str, Any], where: str) -> None:
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

    def _call_output(self, item: Mapping[str, Any], where: str) -> None:
        self._close()
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise OpenAIError(f"{where}.call_id: expected a string", param=where)
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": _text(item.get("output"), f"{where}.output")})

    def _code_interpreter(self, item: Mapping[str, Any], where: str) -> None:
        """A python call the server ran: its code and the logs it printed."""
        code = item.get("code")
        if isinstance(code, str) and code:
            logs = [str(o["logs"]) for o in item.get("outputs") or []
                    if isinstance(o, Mapping) and isinstance(o.get("logs"), str)]
            self._builtin({"recipient": "python", "arguments": code,
                           "output": "".join(logs), "id": item.get("id") or new_id("ci")},
                          where)

    def _builtin(self, item: Mapping[str, Any], where: str) -> None:
        """A built-in tool's call (`browser.search`, `python`) and its result."""
        call_id = str(item.get("id"))
        self._assistant().setdefault("tool_calls", []).append(
            {"id": call_id, "type": "builtin",
             "function": {"name": item.get("recipient"), "arguments": item.get("arguments")}})
        self._close()
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": _text(item.get("output"), f"{where}.output")})

    def _approval(self, item: Mapping[str, Any], where: str) -> None:
        if self._approvals is None:
            raise OpenAIError(f"{where}: an mcp_approval_response answers an MCP tool call; "
                              f"send the request's MCP tools with it", param=where)
        stands_in = self._approvals.get(str(item.get("approval_request_id")))
        if stands_in is not None:
            self.add(stands_in, where)

    def _mcp(self, item: Mapping[str, Any], where: str) -> None:
        """An MCP call the server ran: the call, then its output (or error) as the tool's
        answer, as harmony shows a function call and its result."""
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


def input_messages(raw: str | list[Any],
                   approvals: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) → chat messages (400 on what is unsupported).
    `approvals`: how the request's mcp_approval_response items stand in the conversation
    (kvrelay/server/mcp/setup.py); None: the request has no MCP tools."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    conv = _Conversation(approvals)
    for i, item in enumerate(raw):
        conv.add(item, f"input[{i}]")
    return conv.messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as chat messages (for `previous_response_id`)."""
    conv = _Conversation(internal=True)
    for i, item in enumerate(output):
        conv.add(item, f"output[{i}]")
    return conv.messages


# ------------------------------------------------------------------ the prompt


@dataclass
class Prepared:
    """A request ready for the engine: its conversation, prompt, params and tools."""
    body: ResponsesRequest
    model: str
    messages: list[dict[str, Any]]      # the conversation sent (without instructions)
    rendered: Rendered
    params: Any
    tools: ToolSpec
    owner: str = ""                     # owner_of(...): whose stored response this will be
    mcp: Any = None                     # kvrelay/server/mcp/setup.McpSetup (None: no MCP tools)
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def reasoning_effort(body: ResponsesRequest) -> str | None:
    """`reasoning.effort` (low, medium or high; None: not given)."""
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


def prepare(state: serving.ServerState, store: ResponseStore, body: ResponsesRequest,
            owner: str = "", mcp: Any = None) -> Prepared:
    """`body` → its conversation (after `previous_response_id`'s), prompt and params (400 on
    a bad request). `mcp`: the request's kvrelay/server/mcp/setup.McpSetup, if any."""
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
    messages = history + input_messages(body.input, None if mcp is None else mcp.stand_ins)
    if not messages:
        raise OpenAIError("input: expected at least one item", param="input")
    tools = mcp.tool_spec(body.parallel_tool_calls) if mcp is not None else \
        tool_spec(body.tools, body.tool_choice, body.parallel_tool_calls)
    rendered, params = render_prompt(state, body, model, messages, tools, body.max_output_tokens)
    return Prepared(body, model, messages, rendered, params, tools, owner, mcp=mcp)


def render_prompt(state: serving.ServerState, body: ResponsesRequest, model: str,
                  messages: list[dict[str, Any]], tools: ToolSpec, max_tokens: int | None,
                  within_context: bool = False) -> tuple[Rendered, Any]:
    """The prompt and sampling params of `messages` (the conversation, without the
    instructions) under `body`'s settings. `within_context`: `max_tokens` is cut to the
    room the prompt leaves (a later round of the MCP tool loop) instead of a 400."""
    assert state.chat is not None          # prepare checked it
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        chat = ChatCompletionRequest.model_validate({
            "model": model, "messages": system + messages,
            "reasoning_effort": reasoning_effort(body),
            "tools": [t.as_chat_tool() for t in tools.tools] or None,
            "tool_choice": _chat_choice(tools), "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p, "max_tokens": max_tokens, "seed": body.seed,
            "thinking_token_budget": body.thinking_token_budget})
    except ValidationError as e:    # an input the chat form cannot hold: the client's
        raise OpenAIError(f"input: {e.errors()[0].get('msg', 'invalid')}", param="input") from None
    if not tools.builtin:
        rendered = state.chat.render(chat, state.max_model_len)
    elif isinstance(state.chat, HarmonyChat):
        rendered = state.chat.render(chat, state.max_model_len, builtin=tools.builtin)
    else:
        raise OpenAIError("tools: the built-in browser / python tools need a gpt-oss (harmony) "
                          "model", param="tools")
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
