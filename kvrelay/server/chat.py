"""Chat rendering and output parsing: the checkpoint's own template, or harmony.

The choice is made from the tokenizer (harmony special tokens present), not from
`model_type`. Both renderers give prompt token ids plus extra stop token ids, and
split the output into `content` and (harmony) `reasoning`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server import structured_hooks
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError, message_text
from kvrelay.server.tools import NO_TOOLS, ToolCallOut, ToolSpec, calls_from_json_array, tool_spec


@dataclass
class Rendered:
    prompt_ids: list[int]
    stop_token_ids: list[int] = field(default_factory=list)
    tools: ToolSpec = field(default_factory=ToolSpec)
    # the grammar constraint for SamplingParams (tool_choice required / named), or None
    structured: Any = None


@dataclass
class Parsed:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The OpenAI chat `message` object."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["content"] = self.content or None
            message["tool_calls"] = [c.as_chat() for c in self.tool_calls]
        return message


def finish_reason(engine_reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's `tool_calls` when the turn ended in calls (the engine says "stop")."""
    return "tool_calls" if made_calls and engine_reason == "stop" else engine_reason


class StreamParser(Protocol):
    @property
    def made_calls(self) -> bool: ...   # whether the output so far held tool calls

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]: ...

    def flush(self) -> list[dict[str, Any]]: ...


class ChatRenderer(Protocol):
    def render(self, body: ChatCompletionRequest) -> Rendered: ...

    def parse(self, token_ids: list[int], text: str, tools: ToolSpec = ...) -> Parsed: ...

    def stream_parser(self, tools: ToolSpec = ...) -> StreamParser: ...


def request_tools(body: ChatCompletionRequest) -> ToolSpec:
    return tool_spec(body.tools, body.tool_choice)


def tool_call_deltas(index: int, call: ToolCallOut, arguments: str,
                     first: bool) -> dict[str, Any]:
    """One OpenAI streaming tool-call delta: the first names the call, the rest add
    arguments."""
    entry: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if first:
        entry.update(id=call.id, type="function")
        entry["function"] = {"name": call.name, "arguments": arguments}
    return {"tool_calls": [entry]}


class _TextStream:
    made_calls = False

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def flush(self) -> list[dict[str, Any]]:
        return []


class _ForcedCallStream:
    """A template model's output under `tool_choice` required / named: the grammar makes it
    vLLM's JSON list of calls, returned as tool calls once complete (text if it is not)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.made_calls = False

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        self.text.append(text)
        return []

    def flush(self) -> list[dict[str, Any]]:
        text = "".join(self.text)
        calls = calls_from_json_array(text)
        if calls is None:
            return [{"content": text}] if text else []
        self.made_calls = True
        return [tool_call_deltas(i, c, c.arguments, True) for i, c in enumerate(calls)]


class TemplateChat:
    """The checkpoint's Jinja chat template (e.g. ChatML for the embedded model)."""

    def __init__(self, tokenizer: CheckpointTokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def template_has_tools(self) -> bool:
        return "tools" in (self.tokenizer.chat_template or "")

    def render(self, body: ChatCompletionRequest) -> Rendered:
        spec = request_tools(body)
        messages = [self._message(m.model_dump(exclude_none=True)) for m in body.messages]
        tools = [t.as_chat_tool() for t in spec.offered] if self.template_has_tools else None
        try:
            text = self.tokenizer.render_chat(messages, body.add_generation_prompt,
                                              **({"tools": tools} if tools else {}))
        except Exception as e:  # template errors are the client's (e.g. unsupported roles)
            raise OpenAIError(f"could not render the chat template: {e}", param="messages") from None
        return Rendered(self.tokenizer.encode(text), tools=spec, structured=structured_hooks.tool_call(spec, harmony=False))

    def _message(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A chat message for the template: text content; without a tool syntax in the
        template, earlier calls are shown as their JSON."""
        from kvrelay.server.protocol import ChatMessage
        out = {"role": raw["role"], "content": message_text(ChatMessage.model_validate(raw))}
        calls = raw.get("tool_calls")
        if calls and self.template_has_tools:
            out["tool_calls"] = calls
        elif calls and not out["content"]:
            out["content"] = json.dumps([{"name": c.get("function", {}).get("name"),
                                          "parameters": c.get("function", {}).get("arguments")}
                                         for c in calls], ensure_ascii=False)
        if raw.get("tool_call_id"):
            out["tool_call_id"] = raw["tool_call_id"]
        return out

    def parse(self, token_ids: list[int], text: str, tools: ToolSpec = NO_TOOLS) -> Parsed:
        if tools.choice.forces_call:
            calls = calls_from_json_array(text)
            if calls is not None:
                return Parsed("", tool_calls=calls)
        return Parsed(text)

    def stream_parser(self, tools: ToolSpec = NO_TOOLS) -> StreamParser:
        return _ForcedCallStream() if tools.choice.forces_call else _TextStream()


def make_chat_renderer(tokenizer: CheckpointTokenizer | None) -> ChatRenderer | None:
    if tokenizer is None:
        return None
    from kvrelay.server.harmony_chat import HarmonyChat, is_harmony_tokenizer
    if is_harmony_tokenizer(tokenizer):
        return HarmonyChat(tokenizer)
    if tokenizer.chat_template:
        return TemplateChat(tokenizer)
    return None
