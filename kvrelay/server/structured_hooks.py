"""Tool choice and `text.format` as grammar constraints (`StructuredOutputsParams`).

`tool_choice` required / named and the Responses API's `text.format` become a
`StructuredOutputsParams` on the request's SamplingParams; the grammar engine
(`kvrelay/structured/`, structured outputs' side) compiles it into a token mask. For
harmony checkpoints (`harmony=True`) the constraint covers the assistant turn: optional
free analysis, then the call (`<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>ARGS<|call|>`) or the formatted final answer. Without harmony the whole output is
constrained; a call then is vLLM's JSON list `[{"name": N, "parameters": {...}}]`.

Every constraint made here passes the same bounds and isolated compile check as the
request's own structured-output fields (server/grammar_check.py): a 400 naming
`tools` or `text.format`, before the engine compiles anything.
"""
from __future__ import annotations

import dataclasses
import pkgutil
from typing import Any

from kvrelay.sampling_params import SamplingParams
from kvrelay.server.grammar_check import check_constraint
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.tools import NO_TOOLS, ToolSpec
from kvrelay.structured.manager import requested_budget
from kvrelay.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallConstraint


def available() -> bool:
    """Whether this build has the grammar engine (more in kvrelay/structured/ than the
    params contract), i.e. whether the constraints below are enforced."""
    import kvrelay.structured as package
    return any(m.name != "params" for m in pkgutil.iter_modules(package.__path__))


def _functions(tools: ToolSpec) -> tuple[FunctionSpec, ...]:
    named = [t for t in tools.tools if tools.choice.mode != "named" or t.name == tools.choice.name]
    return tuple(FunctionSpec(t.name, t.parameters) for t in named)


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    """The checked constraint (`check_constraint`); a 400 naming `param` otherwise."""
    try:
        p = StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(str(e), param=param) from None
    check_constraint(p, param)
    return p


def tool_call(tools: ToolSpec, harmony: bool) -> StructuredOutputsParams | None:
    """The constraint of `tool_choice` required / named (None for auto / none)."""
    if not tools.choice.forces_call:
        return None
    return _params("tools", tool_call=ToolCallConstraint(_functions(tools),
                                                         parallel=tools.parallel),
                   harmony=harmony)


def json_format(schema: dict[str, Any], harmony: bool,
                tools: ToolSpec | None = None) -> StructuredOutputsParams:
    """The answer is JSON matching `schema` — or, with tools the model may call (auto), a
    call of one of them."""
    call = None
    if tools is not None and tools.parse_calls and not tools.choice.forces_call:
        call = ToolCallConstraint(_functions(tools), required=False, parallel=tools.parallel)
    return _params("text.format", json=schema, harmony=harmony, tool_call=call)


def attach(params: SamplingParams, constraint: StructuredOutputsParams | None,
           tools: ToolSpec = NO_TOOLS, body: Any = None) -> SamplingParams:
    """Puts the tool-choice constraint on `params`. A forced call wins over a response format
    already there (the call is this turn's answer); a format with tools the model may call
    becomes "a call or the formatted answer". `body` (a ChatCompletionRequest): a harmony
    constraint gets the analysis budget it asks for (`with_budget`)."""
    _attach(params, constraint, tools)
    return with_budget(params, body)


def with_budget(params: SamplingParams, body: Any) -> SamplingParams:
    """A harmony constraint on `params` gets the analysis budget `body` asks for: its
    `thinking_token_budget`, else its `reasoning_effort`'s (manager.requested_budget);
    the engine then caps it to leave room for the answer within max_tokens."""
    p = params.structured_outputs
    if p is None or not p.harmony or body is None:
        return params
    want = requested_budget(getattr(body, "reasoning_effort", None),
                            getattr(body, "thinking_token_budget", None), params.max_tokens)
    if want is not None and want != p.analysis_budget:
        params.structured_outputs = dataclasses.replace(p, analysis_budget=want)
    return params


def _attach(params: SamplingParams, constraint: StructuredOutputsParams | None,
            tools: ToolSpec) -> None:
    current = params.structured_outputs
    if constraint is not None:
        params.structured_outputs = constraint
    elif (current is not None and current.tool_call is None and current.formats()
          and tools.parse_calls):
        combined = dataclasses.replace(
            current, tool_call=ToolCallConstraint(_functions(tools), required=False,
                                                  parallel=tools.parallel))
        check_constraint(combined, "tools")
        params.structured_outputs = combined
