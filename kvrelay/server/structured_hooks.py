"""The seam between tool calling / the Responses API and the grammar engine.

Tool choice `required` / named and `text.format` json_schema are expressed as a grammar
constraint on SamplingParams; the engine that enforces it (the token mask) lives with
structured outputs. Until that interface exists, these return None and nothing is
enforced (the request is still served; a weak model may then not call a tool).
"""
from __future__ import annotations

from typing import Any

from kvrelay.sampling_params import SamplingParams
from kvrelay.server.tools import ToolSpec


def available() -> bool:
    """Whether a grammar engine can enforce constraints in this build."""
    return False


def json_schema(schema: dict[str, Any]) -> Any:
    """The constraint "the whole output is JSON matching `schema`"."""
    return None


def harmony_tool_call(tools: ToolSpec) -> Any:
    """For harmony: the turn must end in a call (of `tools.choice.name` when named) whose
    arguments match the tool's schema; analysis before it stays free."""
    return None


def harmony_final_json(schema: dict[str, Any]) -> Any:
    """For harmony: the final-channel answer is JSON matching `schema`."""
    return None


def attach(params: SamplingParams, constraint: Any) -> SamplingParams:
    return params
