"""Per-request sampling parameters, with vLLM's names, defaults and meanings.

Two layers of validation, both raising `SamplingParamsError` (a `ValueError` naming
the offending field, which the HTTP API returns as the OpenAI error's `param`):

- `SamplingParams.__post_init__`: what can be checked without the model (ranges,
  `min_tokens <= max_tokens`, a seed that fits in int64, finite numbers).
- `validate_for_model`: what needs the model — token ids inside the vocabulary
  (`stop_token_ids`, `logit_bias` keys, prompt ids) and logprob counts. The API
  server runs it before a request reaches the engine, and the engine runs it again
  in `add_request` (the offline API and other callers get the same guarantees).

vLLM's semantics, kept on purpose:
- `temperature` below `SAMPLING_EPS` (1e-5) is greedy (dividing logits by 1e-45 gives
  inf/NaN probabilities); the request's other truncation knobs do not matter then.
- `top_k` 0 or -1 is off, and a `top_k` at least the vocabulary size is also off
  (vLLM clamps it to the vocabulary: keeping every token), not an error.
- `logit_bias` values are clamped to [-100, 100], as vLLM and OpenAI do.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.structured.params import StructuredOutputsParams

if TYPE_CHECKING:           # the API process reads these params without loading torch
    import torch

# (output token ids so far, logits [V] float32) -> logits [V]
LogitsProcessor = Callable[[Sequence[int], "torch.Tensor"], "torch.Tensor"]

SAMPLING_EPS = 1e-5                      # vLLM's _SAMPLING_EPS: below it, temperature is greedy
LOGIT_BIAS_LIMIT = 100.0
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off; >= vocabulary size: off (clamped)
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
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
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
        self._check()
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0       # greedy, as vLLM: 1/temperature would overflow
        self.logit_bias = _clamped_bias(self.logit_bias)

    def _check(self) -> None:
        checks = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0,
             f"temperature must be non-negative (and finite), got {self.temperature}"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0,
             f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1,
             f"min_p must be in [0, 1], got {self.min_p}"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             f"seed must fit in a signed 64-bit integer, got {self.seed}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0,
             f"min_tokens must be non-negative, got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be non-negative, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
            ("stop", all(s for s in self.stop or []), "stop strings must be non-empty"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _clamped_bias(bias: dict | None) -> dict[int, float] | None:
    """Keys as ints (JSON and msgpack maps may carry them as strings); values clamped to ±100."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token, value = int(key), float(value)
        except (TypeError, ValueError):
            raise SamplingParamsError(f"logit_bias: {key!r}: {value!r} is not a token id and a "
                                      "number", "logit_bias") from None
        if not math.isfinite(value):
            raise SamplingParamsError(f"logit_bias[{key}] must be a finite number", "logit_bias")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
    return out


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Every id in [0, vocab_size): an id outside would index past the logits."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(str(t) for t in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise SamplingParamsError(f"{param} token ids must be in [0, {vocab_size}) (the "
                                  f"vocabulary); got {shown}", param)


def validate_for_model(params: SamplingParams, vocab_size: int, max_logprobs: int,
                       logprobs_param: str = "logprobs") -> None:
    """The checks that need the model: vocabulary-sized ids and logprob counts.
    `max_logprobs` is --max-logprobs (-1: up to the vocabulary size)."""
    check_token_ids(params.stop_token_ids or (), vocab_size, "stop_token_ids")
    check_token_ids((params.logit_bias or {}).keys(), vocab_size, "logit_bias")
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name, param in (("logprobs", logprobs_param), ("prompt_logprobs", "prompt_logprobs")):
        asked = getattr(params, name)
        if asked is None or asked <= limit:
            continue
        if limit < max_logprobs or max_logprobs == -1:
            why = f"the vocabulary has {vocab_size} tokens"
        else:
            why = f"the server's --max-logprobs {max_logprobs}"
            why += " (logprobs are disabled on this server)" if max_logprobs == 0 else ""
        raise SamplingParamsError(f"{param}={asked} exceeds {why}", param)
