"""Per-request sampling parameters, with vLLM's names, defaults and meanings."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvrelay.structured.params import StructuredOutputsParams

# (output token ids so far, logits [V] float32) -> logits [V]
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None          # top-N logprobs per output token (plus the sampled one)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # what the output must look like (JSON schema, regex, choice, grammar, tool call)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):      # from a JSON frame
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
