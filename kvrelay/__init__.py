"""kvrelay: exact, readable serving for OpenAI's gpt-oss models.

The package root stays light: importing `kvrelay` does not import torch.
"""
from __future__ import annotations

__version__ = "0.1.0"
