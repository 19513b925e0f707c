"""What every chat renderer gives and takes: the `ChatRenderer` protocol, `Rendered`,
`Parsed`, and the helpers both renderers (`chat.TemplateChat`,
`harmony_chat.HarmonyChat`) use."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.server.protocol import ChatCompletionRequest
from kvrelay.server.tools import ToolCallOut, ToolSpec, tool_spec


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
    # `limit`: the context length; a conversation proven to reach it is a 400 before it is
    # tokenised whole (0: no limit, the caller checks the length)
    def render(self, body: ChatCompletionRequest, limit: int = 0) -> Rendered: ...

    def parse(self, token_ids: list[int], text: str, tools: ToolSpec = ...) -> Parsed: ...

    def stream_parser(self, tools: ToolSpec = ...) -> StreamParser: ...


def request_tools(body: ChatCompletionRequest) -> ToolSpec:
    return tool_spec(body.tools, body.tool_choice, body.parallel_tool_calls)


def tool_call_deltas(index: int, call: ToolCallOut, arguments: str,
                     first: bool) -> dict[str, Any]:
    """One OpenAI streaming tool-call delta: the first names the call, the rest add
    arguments."""
    entry: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if first:
        entry.update(id=call.id, type="function")
        entry["function"] = {"name": call.name, "arguments": arguments}
    return {"tool_calls": [entry]}
