"""Chat rendering and output parsing: the checkpoint's own template, or harmony.

The choice is made from the tokenizer (harmony special tokens present), not from
`model_type`. Both renderers give prompt token ids plus extra stop token ids, and
split the output into `content` and (harmony) `reasoning`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError, message_text


@dataclass
class Rendered:
    prompt_ids: list[int]
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class Parsed:
    content: str
    reasoning: str | None = None


class StreamParser(Protocol):
    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]: ...

    def flush(self) -> list[dict[str, Any]]: ...


class ChatRenderer(Protocol):
    def render(self, body: ChatCompletionRequest) -> Rendered: ...

    def parse(self, token_ids: list[int], text: str) -> Parsed: ...

    def stream_parser(self) -> StreamParser: ...


class _TextStream:
    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def flush(self) -> list[dict[str, Any]]:
        return []


class TemplateChat:
    """The checkpoint's Jinja chat template (e.g. ChatML for the embedded model)."""

    def __init__(self, tokenizer: CheckpointTokenizer) -> None:
        self.tokenizer = tokenizer

    def render(self, body: ChatCompletionRequest) -> Rendered:
        messages = [{"role": m.role, "content": message_text(m)} for m in body.messages]
        try:
            text = self.tokenizer.render_chat(messages, body.add_generation_prompt)
        except Exception as e:  # template errors are the client's (e.g. unsupported roles)
            raise OpenAIError(f"could not render the chat template: {e}", param="messages") from None
        return Rendered(self.tokenizer.encode(text))

    def parse(self, token_ids: list[int], text: str) -> Parsed:
        return Parsed(text)

    def stream_parser(self) -> StreamParser:
        return _TextStream()


def make_chat_renderer(tokenizer: CheckpointTokenizer | None) -> ChatRenderer | None:
    if tokenizer is None:
        return None
    from kvrelay.server.harmony_chat import HarmonyChat, is_harmony_tokenizer
    if is_harmony_tokenizer(tokenizer):
        return HarmonyChat(tokenizer)
    if tokenizer.chat_template:
        return TemplateChat(tokenizer)
    return None
