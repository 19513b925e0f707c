"""kvrelay: exact, readable serving for OpenAI's gpt-oss models.

The package root stays light: importing `kvrelay` does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.llm import LLM
    from kvrelay.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> type:
    # lazy: `from kvrelay import LLM, SamplingParams` without importing torch on `import kvrelay`
    if name == "LLM":
        from kvrelay.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvrelay.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
