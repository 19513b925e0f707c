"""What the engine returns, shaped like vLLM's `RequestOutput`.

msgspec Structs (`array_like`: a field-value array on the wire, no field names), so every
step's engine→API message (`engine/messages.py`, `engine/codec.py`) is encoded and decoded
in C. Mutable: the API side accumulates deltas into them (`CoreClient._accumulate`).
`gc=False`: they hold only strings, numbers and lists of those, never a cycle."""
from __future__ import annotations

import msgspec

from kvrelay.engine.request import Logprob


class CompletionOutput(msgspec.Struct, array_like=True, gc=False):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None           # "stop" | "length" | "abort" | None (running)
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # what this output adds to the previous one of the same request (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = msgspec.field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = msgspec.field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False
    kv_transfer_params: dict | None = None    # prefill side: where a decode server pulls the KV
    error: str | None = None                  # a failed request (e.g. its KV transfer)
    # the HTTP status its client gets: 502 its KV transfer failed, 500 it failed inside a
    # step (the engine went on serving the others)
    error_status: int = 502
