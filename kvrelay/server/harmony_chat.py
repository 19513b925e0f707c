"""Chat for gpt-oss checkpoints in harmony: render with openai-harmony, split the
output into `reasoning` (analysis channel) and `content` (final channel)."""
from __future__ import annotations

from typing import Any

from kvrelay import harmony
from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server.chat import Parsed, Rendered
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError


def is_harmony_tokenizer(tokenizer: CheckpointTokenizer) -> bool:
    return harmony.uses_harmony(tokenizer.tokenizer)


class _HarmonyStream:
    """Channel-by-channel deltas: analysis → `reasoning` (+ `reasoning_content`), final → `content`."""

    def __init__(self) -> None:
        self.parser = harmony.HarmonyStreamParser()

    @staticmethod
    def _as_openai(deltas: list[harmony.Delta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            if not d.text:
                continue
            if d.channel == "analysis":
                out.append({"reasoning": d.text, "reasoning_content": d.text})
            elif d.channel == "final":
                out.append({"content": d.text})
        return out

    def feed(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        deltas: list[harmony.Delta] = []
        for token in token_ids:
            deltas.extend(self.parser.feed(token))
        return self._as_openai(deltas)

    def flush(self) -> list[dict[str, Any]]:
        return self._as_openai(self.parser.close())


class HarmonyChat:
    def __init__(self, tokenizer: CheckpointTokenizer) -> None:
        self.tokenizer = tokenizer
        harmony.get_encoding()                      # fail at startup, not on the first request

    def render(self, body: ChatCompletionRequest) -> Rendered:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            ids = harmony.render_chat(messages, body.reasoning_effort)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        return Rendered(list(ids), harmony.stop_token_ids())

    def parse(self, token_ids: list[int], text: str) -> Parsed:
        result = harmony.parse_completion(token_ids)
        return Parsed(result.content, result.reasoning or None)

    def stream_parser(self) -> _HarmonyStream:
        return _HarmonyStream()
