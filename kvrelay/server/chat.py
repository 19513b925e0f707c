"""Chat rendering and output parsing: the checkpoint's own template, or harmony.

The choice is made from the tokenizer (harmony special tokens present), not from
`model_type`. Both renderers give prompt token ids plus extra stop token ids, and
split the output into `content` and (harmony) `reasoning`. What both share (the
`ChatRenderer` protocol, `Rendered`, `Parsed`) is in `chat_types.py`; `TemplateChat` is
here, `HarmonyChat` in `harmony_chat.py`.
"""
from __future__ import annotations

import json
from typing import Any

from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server import structured_hooks
from kvrelay.server.chat_types import (
    ChatRenderer,
    Parsed,
    Rendered,
    StreamParser,
    finish_reason,
    request_tools,
    tool_call_deltas,
)
from kvrelay.server.harmony_chat import HarmonyChat, is_harmony_tokenizer
from kvrelay.server.limits import check_min_tokens
from kvrelay.server.prompt_tokens import TokenizerFacts, encode_within, tokenizer_facts
from kvrelay.server.protocol import ChatCompletionRequest, ChatMessage, OpenAIError, message_text
from kvrelay.server.tools import NO_TOOLS, ToolSpec, calls_from_json_array

__all__ = ["ChatRenderer", "Parsed", "Rendered", "StreamParser", "TemplateChat", "finish_reason",
           "make_chat_renderer", "request_tools", "tool_call_deltas"]


class _TextStream:
    made_calls = False

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def flush(self) -> list[dict[str, Any]]:
        return []


class _ForcedCallStream:
    """A template model's output under `tool_choice` required / named: the grammar makes it
    vLLM's JSON list of calls, returned as tool calls once complete (text if it is not)."""

    def __init__(self, tools: ToolSpec) -> None:
        self.tools = tools
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
        calls = self.tools.limit(calls)
        self.made_calls = True
        return [tool_call_deltas(i, c, c.arguments, True) for i, c in enumerate(calls)]


class TemplateChat:
    """The checkpoint's Jinja chat template (e.g. ChatML for the embedded model)."""

    def __init__(self, tokenizer: CheckpointTokenizer, facts: TokenizerFacts | None = None) -> None:
        self.tokenizer = tokenizer
        self.facts = facts if facts is not None else tokenizer_facts(tokenizer)

    @property
    def template_has_tools(self) -> bool:
        return "tools" in (self.tokenizer.chat_template or "")

    def render(self, body: ChatCompletionRequest, limit: int = 0) -> Rendered:
        spec = request_tools(body)
        messages = [self._message(m.model_dump(exclude_none=True)) for m in body.messages]
        self._check_size(messages, limit)
        tools = [t.as_chat_tool() for t in spec.offered] if self.template_has_tools else None
        try:
            text = self.tokenizer.render_chat(messages, body.add_generation_prompt,
                                              **({"tools": tools} if tools else {}))
        except Exception as e:  # template errors are the client's (e.g. unsupported roles)
            raise OpenAIError(f"could not render the chat template: {e}",
                              param="messages") from None
        ids = encode_within(self.tokenizer, self.facts, text, limit, "messages", "conversation")
        return Rendered(ids, tools=spec, structured=structured_hooks.tool_call(spec, harmony=False))

    def _check_size(self, messages: list[dict[str, Any]], limit: int) -> None:
        """400 before rendering when the messages' text alone proves the conversation longer
        than `limit` tokens. Counted: the content of every message but the assistant's,
        stripped (templates render it; some trim it, some rewrite assistant turns)."""
        if not limit or not self.facts.longest_token_bytes:
            return
        texts = (m["content"].strip() for m in messages
                 if m["role"] != "assistant" and isinstance(m["content"], str))
        check_min_tokens(texts, limit, self.facts, "messages", "conversation")

    def _message(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A chat message for the template: text content; without a tool syntax in the
        template, earlier calls are shown as their JSON."""
        out = {"role": raw["role"], "content": message_text(ChatMessage.model_validate(raw))}
        calls = raw.get("tool_calls")
        _check_calls(calls)
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
                return Parsed("", tool_calls=tools.limit(calls))
        return Parsed(text)

    def stream_parser(self, tools: ToolSpec = NO_TOOLS) -> StreamParser:
        return _ForcedCallStream(tools) if tools.choice.forces_call else _TextStream()


def make_chat_renderer(tokenizer: CheckpointTokenizer | None,
                       facts: TokenizerFacts | None = None) -> ChatRenderer | None:
    if tokenizer is None:
        return None
    if is_harmony_tokenizer(tokenizer):
        return HarmonyChat(tokenizer, facts)
    if tokenizer.chat_template:
        return TemplateChat(tokenizer, facts)
    return None


def _check_calls(calls: Any) -> None:
    """An assistant message's earlier `tool_calls`, shaped as OpenAI's (the harmony renderer
    checks the same in kvrelay/harmony/render.py): a 400 naming the entry, never a 500."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise OpenAIError("tool_calls: expected a list", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(f"tool_calls[{j}].function.name: expected a string",
                              param="messages")
