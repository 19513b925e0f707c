"""Chat for gpt-oss checkpoints in harmony: render with openai-harmony (tools in the
developer message, earlier calls and tool results in the conversation), split the output
into `reasoning` (analysis channel), `tool_calls` (messages to `functions.NAME`) and
`content` (everything else the model wrote: the final channel, preambles, other channels,
and output that breaks harmony's grammar), whatever tokens the model emits.

The streamed and the whole answer come from the same `_HarmonyStream`, so the deltas of a
stream always add up to the non-streamed message. `one_call_per_turn` ends a turn after
its first call when the request says `parallel_tool_calls: false`.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from kvrelay import harmony
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
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

# ordinary text up to this size is rendered straight away (openai-harmony holds the GIL:
# ~0.3 s a MiB); more is counted first, without the GIL (see HarmonyChat._check)
COUNT_FIRST_BYTES = 2**20


def is_harmony_tokenizer(tokenizer: CheckpointTokenizer) -> bool:
    return harmony.uses_harmony(tokenizer.tokenizer)


def is_function_call(delta: harmony.Delta) -> bool:
    """A delta of a message to `functions.NAME` (NAME a valid function name)."""
    return delta.call_name is not None


DeltaKind = Literal["reasoning", "call", "builtin", "content"]


def delta_kind(delta: harmony.Delta, tools: ToolSpec) -> DeltaKind:
    """Where a delta's text goes: a call of a client function (when the request's calls are
    returned) → the call's arguments; a call of a built-in tool the request enabled
    (`tools.builtin`: browser, python) → that call's arguments (`builtin`); the analysis
    channel → reasoning; anything else (final, preambles, other channels, built-in tools'
    calls not enabled, calls under tool_choice none, malformed output) → content, so no text
    the model wrote is lost."""
    if tools.parse_calls and is_function_call(delta):
        return "call"
    builtin = delta.builtin_call
    if builtin is not None and builtin.split(".")[0] in tools.builtin:
        return "builtin"
    if delta.channel == "analysis":
        return "reasoning"
    return "content"


class _HarmonyStream:
    """Channel-by-channel deltas: analysis → `reasoning` (+ `reasoning_content`), a function
    call → OpenAI tool-call deltas (the first names the call), the rest → `content`. Keeps
    what it sent, so `parsed()` is the sum of the deltas."""

    def __init__(self, tools: ToolSpec = NO_TOOLS) -> None:
        self.parser = harmony.HarmonyStreamParser()
        self.tools = tools
        self.calls: list[ToolCallOut] = []
        self._call_args: list[list[str]] = []
        self._call_message = -1        # the harmony message the last call came from
        self._texts: dict[str, list[str]] = {"reasoning": [], "content": []}

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def _as_openai(self, deltas: list[harmony.Delta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            if not d.text:
                continue
            kind = delta_kind(d, self.tools)
            if kind == "call":
                out.append(self._call_delta(d))
                continue
            if kind == "builtin":       # chat runs no built-in tools: their calls are text
                kind = "content"
            self._texts[kind].append(d.text)
            if kind == "reasoning":
                out.append({"reasoning": d.text, "reasoning_content": d.text})
            else:
                out.append({"content": d.text})
        return out

    def _call_delta(self, d: harmony.Delta) -> dict[str, Any]:
        first = d.message != self._call_message
        if first:
            self._call_message = d.message
            self.calls.append(ToolCallOut(d.call_name or "", ""))
            self._call_args.append([])
        self._call_args[-1].append(d.text)
        return tool_call_deltas(len(self.calls) - 1, self.calls[-1], d.text, first)

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        deltas: list[harmony.Delta] = []
        for token in token_ids:
            deltas.extend(self.parser.feed(token))
        return self._as_openai(deltas)

    def flush(self) -> list[dict[str, Any]]:
        return self._as_openai(self.parser.close())

    def parsed(self) -> Parsed:
        """The whole message: what the deltas so far add up to."""
        reasoning = "".join(self._texts["reasoning"])
        calls = [ToolCallOut(c.name, "".join(args), c.id)
                 for c, args in zip(self.calls, self._call_args)]
        return Parsed("".join(self._texts["content"]), reasoning or None, calls)


class _CallWatch:
    """Where, in one output's tokens, its first function call ends (parallel_tool_calls
    false): a second harmony parser over the same tokens, so it does not depend on the
    consumer's."""

    def __init__(self) -> None:
        self.parser = harmony.HarmonyStreamParser()
        self.seen = 0                       # tokens fed so far

    def end_of_first_call(self, token_ids: list[int]) -> int | None:
        """Feed new tokens; the count of them up to and including the one that ended the
        first call, or None while none has."""
        for i, token in enumerate(token_ids):
            self.parser.feed(token)
            if self.parser.calls_ended:
                self.seen += i + 1
                return i + 1
        self.seen += len(token_ids)
        return None


def _cut(o: CompletionOutput, keep_new: int, total: int) -> CompletionOutput:
    """`o` ended after `keep_new` of its new tokens (`total` tokens in all): a finished copy
    with its own lists (the engine's cumulative lists keep growing). Its text stays as the
    engine gave it: harmony answers are made from the token ids."""
    delta_ids = list(o.delta_token_ids[:keep_new])
    return CompletionOutput(
        o.index, o.text, list(o.token_ids[:total]), "stop", delta_ids[-1] if delta_ids else None,
        None if o.logprobs is None else list(o.logprobs[:total]), o.delta_text, delta_ids,
        None if o.delta_logprobs is None else list(o.delta_logprobs[:keep_new]))


def _ended(o: CompletionOutput) -> CompletionOutput:
    """An output that ended earlier, as a later step shows it: nothing new."""
    return CompletionOutput(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason,
                            o.logprobs, "", [], None if o.delta_logprobs is None else [])


def calls_limited(gen: AsyncIterator[RequestOutput], tools: ToolSpec,
                  renderer: object) -> AsyncIterator[RequestOutput]:
    """`gen`, each turn ended after its first call where the request allows one call
    (`parallel_tool_calls: false`) on a harmony model. (A template model's calls are one
    JSON list: the grammar's `maxItems` and `ToolSpec.limit` hold it to one.)"""
    if isinstance(renderer, HarmonyChat) and tools.parse_calls and not tools.parallel:
        return one_call_per_turn(gen)
    return gen


async def one_call_per_turn(gen: AsyncIterator[RequestOutput]
                            ) -> AsyncGenerator[RequestOutput, None]:
    """`parallel_tool_calls: false` on a harmony model: each output's turn ends with its
    first function call. `<|call|>` (a stop token) already ends the turn; a call closed
    with `<|end|>` (or with a `<|start|>` that begins the next message) would be followed by
    more messages — there the output is cut after the call and finished with "stop" (so
    the answer's finish reason is "tool_calls"), and once every output has finished the
    engine request is closed (aborted) instead of generating on."""
    watches: dict[int, _CallWatch] = {}
    ended: dict[int, CompletionOutput] = {}
    try:
        async for out in gen:
            outputs = []
            for o in out.outputs:
                if o.index in ended:
                    outputs.append(_ended(ended[o.index]))
                    continue
                watch = watches.setdefault(o.index, _CallWatch())
                keep = watch.end_of_first_call(o.delta_token_ids)
                if keep is not None and (o.finish_reason is None or keep < len(o.delta_token_ids)):
                    o = ended[o.index] = _cut(o, keep, watch.seen)
                outputs.append(o)
            out.outputs = outputs
            if ended and not out.finished and all(o.finished for o in outputs):
                out.finished = True
            yield out
            if out.finished:
                return
    finally:
        if isinstance(gen, AsyncGenerator):
            await gen.aclose()


def render_harmony(body: ChatCompletionRequest, tools: ToolSpec) -> list[int]:
    """The harmony prompt of a chat request (with `tools.builtin`'s built-in tools in the
    system message); ValueError on bad messages."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return harmony.render_chat(messages, body.reasoning_effort,
                               [t.as_chat_tool() for t in tools.offered] or None,
                               builtin=tools.builtin)


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

    def render(self, body: ChatCompletionRequest, limit: int = 0,
               builtin: frozenset[str] = frozenset()) -> Rendered:
        """`builtin`: gpt-oss's built-in tools (browser, python) the system message
        describes (the Responses API's MCP tool servers; chat has none)."""
        tools = request_tools(body)
        if builtin:
            tools = dataclasses.replace(tools, builtin=builtin)
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
        """The whole answer: exactly what a stream of the same tokens adds up to."""
        stream = _HarmonyStream(tools)
        stream.feed(token_ids, text)
        stream.flush()
        return stream.parsed()

    def stream_parser(self, tools: ToolSpec = NO_TOOLS) -> _HarmonyStream:
        return _HarmonyStream(tools)
