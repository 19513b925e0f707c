"""OpenAI chat messages → a harmony conversation → prompt token ids (`render_chat`).

The harmony system message is kvrelay's (reasoning effort, built-in tools, an optional
date); the client's system / developer messages become the developer message's
instructions, its function tools the developer message's tools; assistant reasoning, text
and tool calls become analysis, final and commentary messages, tool results messages from
the called function (`_HarmonyMessages`). Raises ValueError on what harmony cannot show.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvrelay.harmony.encoding import (
    BUILTIN_NAMESPACES,
    BUILTIN_RECIPIENTS,
    FUNCTIONS,
    REASONING_EFFORTS,
    get_encoding,
    harmony_module,
)

if TYPE_CHECKING:
    from types import ModuleType

    import openai_harmony

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    """A message's `content`: a string, None, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"{where}.content[{i}]: only text parts are supported, got {kind!r}")
        return "".join(parts)
    raise ValueError(f"{where}.content: expected a string or a list of text parts, "
                     f"got {type(content).__name__}")


def _reasoning_effort(value: str | None) -> openai_harmony.ReasoningEffort | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)}, "
                         f"got {value!r}")
    return harmony_module().ReasoningEffort(value.lower().capitalize())


def _function_tools(
        tools: Sequence[Mapping[str, Any]] | None) -> list[openai_harmony.ToolDescription]:
    oh = harmony_module()
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} "
                             f"tools are supported")
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name: expected a non-empty string")
        out.append(oh.ToolDescription.new(fn["name"], fn.get("description") or "",
                                          parameters=fn.get("parameters")))
    return out


def _drop_answered_reasoning(
        messages: list[openai_harmony.Message]) -> list[openai_harmony.Message]:
    """Drop assistant analysis messages that an assistant final message follows.

    Harmony's rule: the chain of thought of a turn that ended in a `final` answer is not
    shown again. openai-harmony 0.0.8's own `auto_drop_analysis` drops only the analysis
    before the *first* final message, so kvrelay applies the rule itself (as vLLM does);
    analysis of the turn in progress (e.g. before a tool call) is kept.
    A built-in tool's call on the analysis channel (`to=browser.search`) and its result are
    chain of thought too: openai-harmony drops them from answered turns (its own rule).
    """
    last_final = max((i for i, m in enumerate(messages)
                      if m.author.role.value == "assistant" and m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages)
            if not (i < last_final and m.author.role.value == "assistant"
                    and m.channel == "analysis")]


def _system_message(oh: ModuleType, effort: openai_harmony.ReasoningEffort | None,
                    conversation_start_date: str | None,
                    builtin: frozenset[str]) -> openai_harmony.Message:
    """kvrelay's harmony system message: reasoning effort, date, built-in tools."""
    system = oh.SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(effort)
    if conversation_start_date:
        system = system.with_conversation_start_date(conversation_start_date)
    unknown = set(builtin) - set(BUILTIN_NAMESPACES)
    if unknown:
        raise ValueError(f"builtin: unknown built-in tools {sorted(unknown)}")
    if "browser" in builtin:
        system = system.with_browser_tool()
    if "python" in builtin:
        system = system.with_python_tool()
    return oh.Message.from_role_and_content(oh.Role.SYSTEM, system)


class _HarmonyMessages:
    """The harmony messages of one conversation, built from its chat messages in order.
    Owns `out` (the messages so far, the system message first) and which function each
    earlier tool call went to (`tool_names`), so that a tool result finds its author."""

    def __init__(self, oh: ModuleType, system: openai_harmony.Message,
                 function_tools: list[openai_harmony.ToolDescription]) -> None:
        self._oh = oh
        self.out: list[openai_harmony.Message] = [system]
        self._function_tools = function_tools
        self._tools_placed = not function_tools
        self._tool_names: dict[str, str] = {}    # tool_call_id → recipient, for tool results

    def add(self, msg: Any, where: str) -> None:
        """One chat message (`where`: its place, for errors)."""
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: expected an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
        if role in ("system", "developer"):
            self._developer(msg, where)
            return
        self._place_tools()
        if role == "user":
            self._append(self._oh.Role.USER, _text(msg.get("content"), where))
        elif role == "assistant":
            self._assistant(msg, where)
        else:
            self._tool_result(msg, where)

    # -- one message each

    def _append(self, role: Any, content: Any, channel: str | None = None) -> None:
        message = self._oh.Message.from_role_and_content(role, content)
        self.out.append(message if channel is None else message.with_channel(channel))

    def _developer(self, msg: Mapping[str, Any], where: str) -> None:
        """The client's system prompt becomes the developer message's instructions (the
        harmony system message is kvrelay's: identity, reasoning effort, channels); the
        function tools go in the first developer message when it comes right after it."""
        dev = self._oh.DeveloperContent.new().with_instructions(_text(msg.get("content"), where))
        if not self._tools_placed and len(self.out) == 1:
            dev = dev.with_function_tools(self._function_tools)
            self._tools_placed = True
        self._append(self._oh.Role.DEVELOPER, dev)

    def _place_tools(self) -> None:
        """A developer message with the function tools, before the first other message."""
        if self._tools_placed:
            return
        self._append(self._oh.Role.DEVELOPER,
                     self._oh.DeveloperContent.new().with_function_tools(self._function_tools))
        self._tools_placed = True

    def _assistant(self, msg: Mapping[str, Any], where: str) -> None:
        """Reasoning → analysis, text → final, each tool call → a message to its function."""
        reasoning = _reasoning_text(msg, where)
        if reasoning:
            self._append(self._oh.Role.ASSISTANT, reasoning, "analysis")
        content = _text(msg.get("content"), where)
        calls = msg.get("tool_calls") or []
        if content or (not calls and not reasoning):
            self._append(self._oh.Role.ASSISTANT, content, "final")
        for j, call in enumerate(calls):
            self._call(call, f"{where}.tool_calls[{j}]")

    def _call(self, call: Any, where: str) -> None:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.function.name: expected a string")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args)
        # a built-in tool's call (`type: "builtin"`, name `browser.search` / `python`)
        # goes to that recipient on the analysis channel, as gpt-oss writes it
        inner = call.get("type") == "builtin" and fn["name"] in BUILTIN_RECIPIENTS
        recipient = fn["name"] if inner else f"{FUNCTIONS}{fn['name']}"
        if call.get("id"):
            self._tool_names[str(call["id"])] = recipient
        message = self._oh.Message.from_role_and_content(self._oh.Role.ASSISTANT, args) \
            .with_channel("analysis" if inner else "commentary").with_recipient(recipient)
        self.out.append(message.with_content_type(
            "code" if recipient == "python" else "<|constrain|>json"))

    def _tool_result(self, msg: Mapping[str, Any], where: str) -> None:
        """A tool's answer, authored by the function (or built-in tool) that was called."""
        name = msg.get("name")
        recipient = f"{FUNCTIONS}{name}" if name else \
            self._tool_names.get(str(msg.get("tool_call_id")))
        if not recipient:
            raise ValueError(f"{where}: a tool message needs a 'tool_call_id' of an earlier "
                             f"assistant tool call (or a 'name')")
        author = self._oh.Author.new(self._oh.Role.TOOL, recipient)
        channel = "commentary" if recipient.startswith(FUNCTIONS) else "analysis"
        self.out.append(self._oh.Message.from_author_and_content(
            author, _text(msg.get("content"), where))
            .with_recipient("assistant").with_channel(channel))


def _reasoning_text(msg: Mapping[str, Any], where: str) -> str | None:
    """An assistant message's reasoning: `reasoning_content`, else `reasoning`."""
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}.reasoning: expected a string")
    return reasoning


def build_conversation(messages: Sequence[Mapping[str, Any]], reasoning_effort: str | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None, *,
                       conversation_start_date: str | None = None,
                       builtin: frozenset[str] = frozenset()) -> openai_harmony.Conversation:
    """OpenAI chat messages → an openai-harmony `Conversation` (see `render_chat`)."""
    oh = harmony_module()
    effort = _reasoning_effort(reasoning_effort)
    function_tools = _function_tools(tools)
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages: expected a non-empty list of chat messages")
    harmony_messages = _HarmonyMessages(
        oh, _system_message(oh, effort, conversation_start_date, builtin),
        function_tools)
    for i, msg in enumerate(messages):
        harmony_messages.add(msg, f"messages[{i}]")
    return oh.Conversation.from_messages(_drop_answered_reasoning(harmony_messages.out))


def render_chat(messages: Sequence[Mapping[str, Any]], reasoning_effort: str | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None, *,
                conversation_start_date: str | None = None,
                builtin: frozenset[str] = frozenset()) -> list[int]:
    """OpenAI chat messages → harmony prompt token ids ending with `<|start|>assistant`.

    messages: roles system / developer (→ harmony developer instructions), user, assistant
    (`content`; `reasoning_content` or `reasoning` → an analysis message, dropped once a later
    final answer exists; `tool_calls` → commentary messages to `functions.NAME`) and tool
    (`tool_call_id` of an earlier call, `content`). Content: a string or a list of
    `{"type": "text", "text": ...}` parts. reasoning_effort: "low" | "medium" | "high"
    (None: harmony's default, medium). tools: OpenAI function tools. The harmony system
    message carries no date unless `conversation_start_date` ("YYYY-MM-DD") is given,
    so equal requests render to equal tokens. builtin: gpt-oss's built-in tools to describe
    in the system message (`browser`, `python`: openai-harmony's `## browser` / `## python`
    sections); their calls are assistant `tool_calls` of `type: "builtin"` named
    `browser.search` / `python`, their results tool messages answering those calls (author
    `browser.search`, analysis channel). Raises ValueError on bad input.
    """
    oh = harmony_module()
    conv = build_conversation(messages, reasoning_effort, tools,
                              conversation_start_date=conversation_start_date,
                              builtin=builtin)
    return list(get_encoding().render_conversation_for_completion(conv, oh.Role.ASSISTANT))


