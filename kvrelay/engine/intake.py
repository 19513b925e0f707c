"""What `LLMEngine.add_request` checks before a request enters the engine, so that nothing
about it can fail later inside a step for a reason known now (`failures.py` handles the
rest), and the --logits-processors factories it applies to each request."""
from __future__ import annotations

import importlib
from typing import Any

from kvrelay.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    check_token_ids,
    validate_for_model,
)


def check_request(params: SamplingParams, ids: list[int], vocab_size: int, max_logprobs: int,
                  max_model_len: int) -> None:
    """The prompt's ids and the sampling parameters against the model; SamplingParamsError
    (a ValueError naming the request field) otherwise."""
    if not ids:
        raise SamplingParamsError("the prompt is empty", "prompt")
    check_token_ids(ids, vocab_size, "prompt")
    validate_for_model(params, vocab_size, max_logprobs)
    if len(ids) >= max_model_len:
        raise SamplingParamsError(f"the prompt has {len(ids)} tokens; max_model_len is "
                                  f"{max_model_len}", "prompt")
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise SamplingParamsError(f"prompt ({len(ids)} tokens) + max_tokens "
                                  f"({params.max_tokens}) exceeds max_model_len "
                                  f"{max_model_len}", "max_tokens")


def load_processor_factory(name: str) -> Any:
    """"package.module:attr" → the object (for --logits-processors)."""
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"--logits-processors: {name!r} is not of the form module:attr")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--logits-processors: cannot load {name!r} ({e})") from None
