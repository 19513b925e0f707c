"""A response's output: completion tokens → output items and the streaming events that
describe them, one `OutputBuilder` for both the streamed and the whole answer.

Each harmony message becomes an output item (analysis → `reasoning`, a call to
`functions.NAME` → `function_call`, any other text → `message`: `harmony_chat.delta_kind`,
as chat splits it), each with the events the openai client parses:

    response.output_item.added → response.content_part.added (not for a call)
      → *.delta … → *.done → response.content_part.done → response.output_item.done

`Decoder` feeds the builder: a harmony model's tokens through harmony's parser, a
template model's text as it is.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvrelay import harmony
from kvrelay.server.harmony_chat import delta_kind
from kvrelay.server.tools import ToolCallOut, ToolSpec, calls_from_json_array


def new_id(prefix: str) -> str:
    """A fresh id of an item or response: `msg_…`, `fc_…`, `resp_…`."""
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


class OutputBuilder:
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
        elif kind == "builtin":     # named by its recipient; the MCP loop makes it its item
            self._text("function_call", delta.message, delta.text, delta.builtin_call)
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
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "content": [],
                    "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            call = ToolCallOut(name or "", "")
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id,
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


MESSAGE_ENDS = (harmony.END_ID, harmony.RETURN_ID, harmony.CALL_ID)


class Decoder:
    """Completion tokens → the builder: through harmony's parser, or as text."""

    def __init__(self, harmony_model: bool, builder: OutputBuilder) -> None:
        self.builder = builder
        self.parser = harmony.HarmonyStreamParser() if harmony_model else None
        self.reasoning_tokens = 0

    def feed(self, token_ids: list[int], text: str) -> None:
        if self.parser is None:
            self.builder.text(text)
            return
        for token in token_ids:
            # the analysis message's text tokens (not its header or its <|end|>)
            if self.parser.content_channel == "analysis" and token not in MESSAGE_ENDS:
                self.reasoning_tokens += 1
            for delta in self.parser.feed(token):
                self.builder.harmony(delta)

    def close(self) -> None:
        if self.parser is not None:
            for delta in self.parser.close():
                self.builder.harmony(delta)

