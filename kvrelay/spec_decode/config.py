"""`--speculative-config` (and `LLM(speculative_config=...)`): vLLM's SpeculativeConfig for
the n-gram and draft-model methods, their keys and rules.

    {"method": "ngram", "num_speculative_tokens": K,
     "prompt_lookup_max": N, "prompt_lookup_min": M}
    {"model": PATH, "num_speculative_tokens": K}          (method "draft_model")

vLLM's rules, kept: `num_speculative_tokens` is required; both lookup bounds unset mean 5
and 5, one unset takes the other's value, and 1 <= min <= max; `"model": "ngram"` (or
`"[ngram]"`) without `method` names the method too; any other `"model"` is a draft model's
checkpoint directory (method "draft_model", checked here to hold a config.json; its vocab
and tokenizer against the target's: kvrelay/config.py). A draft runs on one rank only
(`draft_tensor_parallel_size` 1). vLLM's other methods (eagle, medusa, mtp, ...) are refused
with one line naming what is supported. Torch-free: the API process checks the flag before
any model loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLAG = "--speculative-config"
METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "draft_tensor_parallel_size")
# a verification step computes 1 + K rows per request; past this a step is mostly waste
MAX_SPECULATIVE_TOKENS = 64
DEFAULT_LOOKUP = 5                          # vLLM's default for both lookup bounds
SUPPORTED = ('supported: {"method": "ngram", "num_speculative_tokens": K, '
             '"prompt_lookup_max": N, "prompt_lookup_min": M} or '
             '{"model": DRAFT_CHECKPOINT_DIR, "num_speculative_tokens": K}')


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    method: str = "ngram"
    model: str | None = None            # the draft checkpoint (method "draft_model")

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{FLAG}: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{FLAG}: num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{FLAG}: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                             f"exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method not in METHODS:
            raise ValueError(f"{FLAG}: method {self.method!r} is not supported; {SUPPORTED}")
        if self.method == "draft_model":
            _check_draft_dir(self.model)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | SpeculativeConfig | None
                  ) -> SpeculativeConfig | None:
        """The flag's object checked and resolved (ValueError: one line naming the key);
        None when the flag is unset."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"{FLAG} must be a JSON object; {SUPPORTED}")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ValueError(f"{FLAG}: unknown key {unknown[0]!r}; {SUPPORTED}")
        method = _method(raw.get("method"), raw.get("model"))
        if raw.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError(f"{FLAG}: draft_tensor_parallel_size "
                             f"{raw['draft_tensor_parallel_size']!r} is not supported: a draft "
                             f"model runs on one rank (1)")
        if "num_speculative_tokens" not in raw:
            raise ValueError(f"{FLAG}: num_speculative_tokens is required; {SUPPORTED}")
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        low = low if low is not None else high if high is not None else DEFAULT_LOOKUP
        high = high if high is not None else low
        model = raw.get("model") if method == "draft_model" else None
        return cls(raw["num_speculative_tokens"], high, low, method, model)


def _method(method: Any, model: Any) -> str:
    """The method named by `method`, or by vLLM's `"model"` spelling: "ngram" (or
    "[ngram]"), else a draft model's path; other methods are refused."""
    named_ngram = model in ("ngram", "[ngram]")
    if method is None:
        if model is None:
            raise ValueError(f"{FLAG}: method is required; {SUPPORTED}")
        return "ngram" if named_ngram else "draft_model"
    if method in ("ngram", "[ngram]") and (model is None or named_ngram):
        return "ngram"
    if method == "draft_model" and model is not None and not named_ngram:
        return "draft_model"
    if method in METHODS:
        raise ValueError(f"{FLAG}: method {method!r} does not go with \"model\": {model!r}; "
                         f"{SUPPORTED}")
    raise ValueError(f"{FLAG}: method {method!r} is not supported; {SUPPORTED}")


def _check_draft_dir(model: str | None) -> None:
    """A draft model's checkpoint: a local directory with a config.json."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"{FLAG}: a draft model needs \"model\": its checkpoint directory; "
                         f"{SUPPORTED}")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"{FLAG}: draft model {model!r}: not a checkpoint directory (no "
                         f"config.json there)")
