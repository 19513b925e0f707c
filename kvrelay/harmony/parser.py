"""Completion tokens of an assistant turn → text deltas tagged with their channel
(`HarmonyStreamParser`: `analysis` is the reasoning, `final` the answer, `commentary` with a
recipient a tool call), and at the end a `ParsedChat`. Never raises on what a model writes:
output that breaks harmony's grammar is read as final content from there on.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvrelay.harmony.encoding import (
    BUILTIN_RECIPIENTS,
    CALL_ID,
    CHANNEL_ID,
    CONSTRAIN_ID,
    END_ID,
    FIRST_SPECIAL_ID,
    FUNCTIONS,
    MESSAGE_END_IDS,
    MESSAGE_ID,
    RETURN_ID,
    START_ID,
    get_encoding,
    harmony_module,
)

if TYPE_CHECKING:
    import openai_harmony

# the longest message header we accept before calling the output malformed
# (a real one is `<|channel|>commentary to=functions.NAME <|constrain|>json`, ~10 tokens)
MAX_HEADER_TOKENS = 128
# a function name a call may carry (the names `tools` accepts: kvrelay/server/tools.py)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def call_name(channel: str | None, recipient: str | None) -> str | None:
    """The client function a message calls: NAME for a message to `functions.NAME` on a
    channel other than `final` (commentary, as harmony prescribes; analysis too, as vLLM
    reads it), when NAME is a valid function name. None for anything else: gpt-oss's
    built-in tools (`to=python`, `to=browser.search`), a garbled or empty address
    (`to=functions.`, `to=functions.a b`)."""
    if not recipient or not recipient.startswith(FUNCTIONS) or channel in (None, "final"):
        return None
    name = recipient[len(FUNCTIONS):]
    return name if _FUNCTION_NAME.fullmatch(name) else None


def builtin_call(channel: str | None, recipient: str | None) -> str | None:
    """The built-in tool a message calls (`browser.search|open|find`, `python`) on a channel
    other than `final`, or None."""
    if recipient in BUILTIN_RECIPIENTS and channel not in (None, "final"):
        return recipient
    return None


@dataclass(frozen=True)
class Delta:
    """New text of one message. channel: "analysis" (reasoning), "final" (the answer; also
    channel-less messages and malformed output), "commentary" (tool calls when `recipient`
    is set, e.g. "functions.get_weather"; else preambles meant for the user) or any other
    channel the model names."""
    channel: str
    text: str
    recipient: str | None = None
    message: int = 0      # which message of the turn (0, 1, ...): tells two calls apart

    @property
    def call_name(self) -> str | None:
        """The function this message calls (see `call_name`), or None."""
        return call_name(self.channel, self.recipient)

    @property
    def builtin_call(self) -> str | None:
        """The built-in tool this message calls (see `builtin_call`), or None."""
        return builtin_call(self.channel, self.recipient)


@dataclass(frozen=True)
class ToolCall:
    name: str          # the recipient without "functions.", e.g. "get_weather"
    arguments: str     # the message text (JSON when the model constrained it so)
    recipient: str     # as the model wrote it, e.g. "functions.get_weather"


@dataclass
class ParsedChat:
    reasoning: str = ""        # analysis channel
    content: str = ""          # final channel (or the whole text when malformed)
    commentary: str = ""       # commentary without a recipient (preambles)
    tool_calls: list[ToolCall] = field(default_factory=list)
    # "stop" after <|return|>, "tool_calls" after <|call|>, None when no stop token came
    # (the caller knows whether it was max_tokens: "length")
    finish: Literal["stop", "tool_calls"] | None = None
    malformed: bool = False    # the output broke harmony's grammar; rest decoded as content


class _IncrementalDecoder:
    """Token ids → text pieces, holding back incomplete UTF-8 and dropping special tokens."""

    def __init__(self, encoding: openai_harmony.HarmonyEncoding) -> None:
        self._enc = encoding
        self._pending: list[int] = []

    def feed(self, token: int) -> str:
        try:
            if self._enc.is_special_token(token):
                return ""
        except Exception:
            return ""            # not a token of the vocabulary at all
        self._pending.append(token)
        try:
            text = self._enc.decode(self._pending)
        except Exception:
            self._pending.pop()
            return ""
        if text.endswith("\ufffd") and len(self._pending) < 4:
            return ""            # a multi-byte character may complete with the next token
        self._pending.clear()
        return text

    def flush(self) -> str:
        text = self._enc.decode(self._pending) if self._pending else ""
        self._pending.clear()
        return text


class HarmonyStreamParser:
    """Parses an assistant turn's completion tokens (after the prompt's `<|start|>assistant`).

        parser = HarmonyStreamParser()
        for token in generated:
            for delta in parser.feed(token):
                ...  # delta.channel == "analysis" → reasoning, "final" → content
        deltas = parser.close()   # flush (also done by result())
        chat = parser.result()    # ParsedChat(reasoning, content, finish, ...)

    Built on openai-harmony's StreamableParser. Output that breaks harmony's grammar (text
    where a header belongs, a header that never ends, text after `<|end|>` without
    `<|start|>`) never raises: from there on the decoded text is treated as final content,
    and `result().malformed` is True. Inside a message's text, `<|start|>` or `<|channel|>`
    ends the message (the model began the next one without `<|end|>`), and the other special
    tokens (`<|constrain|>`, `<|message|>`, `<|endoftext|>`, reserved ids) are not text and
    are dropped. The concatenated deltas of each channel always equal the corresponding
    `result()` field.
    """

    def __init__(self) -> None:
        oh = harmony_module()
        self._enc = get_encoding()
        self._parser = oh.StreamableParser(self._enc, role=oh.Role.ASSISTANT)
        # the parser's state, mirrored from the tokens: reading `StreamableParser.state`
        # serializes the whole message so far (quadratic over a long answer)
        self._in_content = False
        self._unaccounted: list[int] = []   # tokens not yet turned into text or structure
        self._fallback: _IncrementalDecoder | None = None
        self._closed = False
        self._chat = ParsedChat()
        self._texts: dict[str, list[str]] = {"reasoning": [], "content": [], "commentary": []}
        self._msg_channel: str | None = None
        self._msg_recipient: str | None = None
        self._msg_text: list[str] = []
        self._msg_index = -1

    # -- public

    @property
    def malformed(self) -> bool:
        return self._fallback is not None

    @property
    def content_channel(self) -> str | None:
        """The channel of the message whose text is being read (None inside a header or
        between messages; "final" once the output is malformed)."""
        if self._fallback is not None:
            return "final"
        return (self._msg_channel or "final") if self._in_content else None

    @property
    def calls_ended(self) -> int:
        """How many function calls (messages to `functions.NAME`) have ended so far."""
        return len(self._chat.tool_calls)

    def feed(self, token_id: int) -> list[Delta]:
        """Process one generated token; the text it completes, by channel (one delta or none)."""
        if self._closed:
            raise RuntimeError("HarmonyStreamParser: feed() after close()")
        token = int(token_id)
        if self._fallback is not None:
            return self._fallback_feed(token)
        if token in (RETURN_ID, CALL_ID) and self._chat.finish is None:
            self._chat.finish = "stop" if token == RETURN_ID else "tool_calls"
        if self._in_content and not FIRST_SPECIAL_ID > token >= 0 \
                and token not in MESSAGE_END_IDS:
            if token in (START_ID, CHANNEL_ID):
                return self._implicit_end(token)
            return []                         # a special token inside text is no text
        was_content = self._in_content
        try:
            self._parser.process(token)
        except Exception:  # openai_harmony.HarmonyError: the token breaks the grammar
            return self._enter_fallback(token)
        if was_content:
            in_content = token not in (END_ID, RETURN_ID, CALL_ID)
        else:
            in_content = token == MESSAGE_ID
        self._in_content = in_content
        if not in_content:
            if was_content:
                self._end_message()           # <|end|>, <|return|> or <|call|>
                self._unaccounted.clear()
                return []
            if token in (END_ID, RETURN_ID, CALL_ID) or len(self._unaccounted) >= MAX_HEADER_TOKENS:
                # a message end inside a header, or a header that never ends: not harmony
                return self._enter_fallback(token)
            self._unaccounted.append(token)   # header token
            return []
        if not was_content:                   # <|message|>: the header is complete
            self._msg_channel = self._parser.current_channel
            recipient = self._parser.current_recipient
            # a recipient with special tokens in it is a misparse (e.g. a repeated
            # `<|start|>assistant` before the channel), not an address
            self._msg_recipient = recipient if recipient and "<|" not in recipient else None
            self._msg_text = []
            self._msg_index += 1
            self._unaccounted.clear()
            return []
        self._unaccounted.append(token)
        text = self._parser.last_content_delta
        if not text:
            return []                         # e.g. part of a multi-byte character
        self._unaccounted.clear()
        return [self._emit(self._msg_channel, self._msg_recipient, text)]

    def close(self) -> list[Delta]:
        """End of generation: flush what is held back (idempotent)."""
        if self._closed:
            return []
        out: list[Delta] = []
        if self._fallback is not None:
            text = self._fallback.flush()
            if text:
                out.append(self._emit("final", None, text))
        elif self._in_content:
            # truncated mid-message (max_tokens): keep what the parser holds back
            done = "".join(self._msg_text)
            current = self._parser.current_content
            if current.startswith(done) and len(current) > len(done):
                out.append(self._emit(self._msg_channel, self._msg_recipient, current[len(done):]))
            self._drop_message()               # an unfinished call is no tool call
        elif self._unaccounted and not any(t in (START_ID, CHANNEL_ID, CONSTRAIN_ID)
                                           for t in self._unaccounted):
            # ended inside a "header" of plain text: output without harmony, show it as content
            # (a header cut short, e.g. `<|start|>assistant<|channel|>`, is just dropped)
            out = self._enter_fallback(None)
            assert self._fallback is not None          # _enter_fallback set it
            text = self._fallback.flush()
            if text:
                out.append(self._emit("final", None, text))
        self._closed = True
        return out

    def result(self) -> ParsedChat:
        """The turn so far, split by channel (closes the parser)."""
        self.close()
        for name, parts in self._texts.items():
            setattr(self._chat, name, "".join(parts))
        self._chat.malformed = self._fallback is not None
        return self._chat

    # -- internals

    def _implicit_end(self, token: int) -> list[Delta]:
        """`<|start|>` or `<|channel|>` inside a message's text: end the message as `<|end|>`
        would, then read `token` as the start of the next message's header."""
        try:
            self._parser.process(END_ID)
            if token == CHANNEL_ID:          # the next header, as `<|start|>assistant` begins it
                for t in self._enc.encode("<|start|>assistant", allowed_special="all"):
                    self._parser.process(t)
        except Exception:  # openai_harmony.HarmonyError (not expected: END is valid here)
            return self._enter_fallback(token)
        self._in_content = False
        self._end_message()
        self._unaccounted.clear()
        return self.feed(token)

    def _emit(self, channel: str | None, recipient: str | None, text: str) -> Delta:
        channel = channel or "final"
        self._msg_text.append(text)
        if channel == "analysis":
            self._texts["reasoning"].append(text)
        elif channel == "final":
            self._texts["content"].append(text)
        elif channel == "commentary" and not recipient:
            self._texts["commentary"].append(text)
        return Delta(channel, text, recipient, max(self._msg_index, 0))

    def _end_message(self) -> None:
        recipient = self._msg_recipient
        # a call of a client's function (the commentary channel, to=functions.NAME); calls of
        # gpt-oss's built-in tools (to=python, to=browser.*) stay text of their channel
        name = call_name(self._msg_channel, recipient)
        arguments = "".join(self._msg_text)
        # a call message without text (not even `{}`) shows nothing to call with: no call
        if name is not None and recipient is not None and arguments:
            self._chat.tool_calls.append(ToolCall(name, arguments, recipient))
        self._drop_message()

    def _drop_message(self) -> None:
        self._msg_channel, self._msg_recipient, self._msg_text = None, None, []

    def _enter_fallback(self, token: int | None) -> list[Delta]:
        # from here on everything not yet shown (a broken header, bytes the parser held
        # back) is decoded as plain content
        out: list[Delta] = []
        self._drop_message()
        self._fallback = _IncrementalDecoder(self._enc)
        pending = self._unaccounted + ([token] if token is not None else [])
        self._unaccounted = []
        for t in pending:
            out += self._fallback_feed(t)
        return out

    def _fallback_feed(self, token: int) -> list[Delta]:
        if token in (RETURN_ID, CALL_ID) and self._chat.finish is None:
            self._chat.finish = "stop" if token == RETURN_ID else "tool_calls"
        assert self._fallback is not None          # called only in fallback mode
        text = self._fallback.feed(token)
        return [self._emit("final", None, text)] if text else []


def parse_completion(token_ids: Iterable[int]) -> ParsedChat:
    """Parse a whole completion at once (same result as feeding it token by token)."""
    parser = HarmonyStreamParser()
    for token in token_ids:
        parser.feed(token)
    return parser.result()
