"""Chat for gpt-oss checkpoints in harmony: render with openai-harmony (tools in the
developer message, earlier calls and tool results in the conversation), split the output
into `reasoning` (analysis channel), `content` (final channel) and `tool_calls`
(commentary-channel messages to `functions.NAME`)."""
from __future__ import annotations

import json
from typing import Any

from kvrelay import harmony
from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server import structured_hooks
from kvrelay.server.chat_types import Parsed, Rendered, request_tools, tool_call_deltas
from kvrelay.server.harmony_guard import check_piece_work, long_runs
from kvrelay.server.limits import check_min_tokens
from kvrelay.server.prompt_tokens import (
    TokenizerFacts,
    count_within,
    hf_tokenizer,
    tokenizer_facts,
    utf8_len,
)
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError
from kvrelay.server.tools import NO_TOOLS, ToolCallOut, ToolSpec

FUNCTIONS = "functions."
# ordinary text up to this size is rendered straight away (openai-harmony holds the GIL:
# ~0.3 s a MiB); more is counted first, without the GIL (see HarmonyChat._check)
COUNT_FIRST_BYTES = 2**20


def is_harmony_tokenizer(tokenizer: CheckpointTokenizer) -> bool:
    return harmony.uses_harmony(tokenizer.tokenizer)


def is_function_call(delta: harmony.Delta) -> bool:
    return bool(delta.recipient and delta.recipient.startswith(FUNCTIONS)
                and delta.channel != "final")


class _HarmonyStream:
    """Channel-by-channel deltas: analysis → `reasoning` (+ `reasoning_content`), final →
    `content`, a function call → OpenAI tool-call deltas (the first names the call)."""

    def __init__(self, tools: ToolSpec = NO_TOOLS) -> None:
        self.parser = harmony.HarmonyStreamParser()
        self.tools = tools
        self.calls: list[ToolCallOut] = []
        self._call_message = -1        # the harmony message the last call came from

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def _as_openai(self, deltas: list[harmony.Delta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            if not d.text:
                continue
            if d.channel == "analysis":
                out.append({"reasoning": d.text, "reasoning_content": d.text})
            elif d.channel == "final":
                out.append({"content": d.text})
            elif self.tools.parse_calls and is_function_call(d):
                out.append(self._call_delta(d))
        return out

    def _call_delta(self, d: harmony.Delta) -> dict[str, Any]:
        first = d.message != self._call_message
        if first:
            self._call_message = d.message
            self.calls.append(ToolCallOut((d.recipient or "")[len(FUNCTIONS):], ""))
        return tool_call_deltas(len(self.calls) - 1, self.calls[-1], d.text, first)

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        deltas: list[harmony.Delta] = []
        for token in token_ids:
            deltas.extend(self.parser.feed(token))
        return self._as_openai(deltas)

    def flush(self) -> list[dict[str, Any]]:
        return self._as_openai(self.parser.close())


def render_harmony(body: ChatCompletionRequest, tools: ToolSpec) -> list[int]:
    """The harmony prompt of a chat request; ValueError on bad messages."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return harmony.render_chat(messages, body.reasoning_effort,
                               [t.as_chat_tool() for t in tools.offered] or None)


def parsed_calls(chat: harmony.ParsedChat, tools: ToolSpec) -> list[ToolCallOut]:
    if not tools.parse_calls:
        return []
    return [ToolCallOut(c.name, c.arguments) for c in chat.tool_calls]


def _texts(body: ChatCompletionRequest) -> list[str]:
    """The text harmony renders verbatim: every message's content (text parts) and earlier
    calls' arguments (reasoning is left out: answered turns drop it)."""
    texts: list[str] = []
    for m in body.messages:
        if isinstance(m.content, str):
            texts.append(m.content)
        elif isinstance(m.content, list):
            texts.extend(p["text"] for p in m.content if isinstance(p.get("text"), str))
        for call in getattr(m, "tool_calls", None) or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                texts.append(fn["arguments"])
    return texts


def _tool_texts(body: ChatCompletionRequest) -> list[str]:
    """The tools as text (harmony renders their names, descriptions and schemas)."""
    return [json.dumps(body.tools, ensure_ascii=False)] if body.tools else []


class HarmonyChat:
    def __init__(self, tokenizer: CheckpointTokenizer | None,
                 facts: TokenizerFacts | None = None) -> None:
        self.tokenizer = tokenizer
        self.facts = facts if facts is not None else tokenizer_facts(tokenizer)
        harmony.get_encoding()                      # fail at startup, not on the first request

    def render(self, body: ChatCompletionRequest, limit: int = 0) -> Rendered:
        tools = request_tools(body)
        self._check(body, limit)
        try:
            ids = render_harmony(body, tools)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        except BaseException as e:   # openai-harmony's Rust panics (pyo3 PanicException)
            if type(e).__name__ != "PanicException":
                raise
            raise OpenAIError(f"the conversation could not be rendered: openai-harmony failed "
                              f"on it ({e})", param="messages") from None
        return Rendered(list(ids), harmony.stop_token_ids(), tools=tools,
                        structured=structured_hooks.tool_call(tools, harmony=True))

    def _check(self, body: ChatCompletionRequest, limit: int) -> None:
        """400 before rendering (openai-harmony holds the GIL while it tokenises, and takes
        time quadratic in a long run of one kind of character):
        - by the text's bytes, when they prove more than `limit` tokens (o200k: no token
          covers more than 128 bytes);
        - by counting its tokens with the checkpoint's o200k tokenizer, in pieces, without
          the GIL (harmony's prompt holds at least these), when the text could hold `limit`
          tokens and is long (COUNT_FIRST_BYTES) or has long runs to look into;
        - by the cost of its long runs to harmony's tokenizer (server/harmony_guard.py)."""
        texts = _texts(body)
        if limit:
            check_min_tokens(texts, limit, self.facts, "messages", "conversation")
        words, work = long_runs(texts + _tool_texts(body))
        nbytes = sum(map(utf8_len, texts))          # a token covers at least one byte
        if (limit and self.tokenizer is not None and nbytes >= limit
                and (words or nbytes >= COUNT_FIRST_BYTES)):
            count_within(self.tokenizer, self.facts, texts, limit, "messages", "conversation")
        check_piece_work(hf_tokenizer(self.tokenizer), words, work)

    def parse(self, token_ids: list[int], text: str, tools: ToolSpec = NO_TOOLS) -> Parsed:
        result = harmony.parse_completion(token_ids)
        return Parsed(result.content, result.reasoning or None, parsed_calls(result, tools))

    def stream_parser(self, tools: ToolSpec = NO_TOOLS) -> _HarmonyStream:
        return _HarmonyStream(tools)
