"""What a request's output must look like: the typed contract between the API server (which
turns `response_format`, `structured_outputs`, `guided_*` and `tool_choice` into it) and the
engine (which compiles it into a token mask per step). Torch-free, picklable, JSON-able.

Exactly one *format* is set (`json`, `regex`, `choice`, `grammar`, `json_object`), or a
`tool_call`, or both a format and a non-required `tool_call` (the answer is either a call or
the formatted text).

Harmony (`harmony=True`, set by the server for chat/responses on gpt-oss checkpoints, whose
prompt ends with `<|start|>assistant`): the constraint covers the whole assistant turn from
its first sampled token —

    [<|channel|>analysis<|message|> free text (≤ analysis_budget tokens) <|end|><|start|>assistant]
    then  <|channel|>final<|message|> FORMATTED TEXT <|return|>
    or    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> ARGS <|call|>

where ARGS is valid against NAME's `parameters` schema. Without `harmony` the constraint
covers the whole output; a `tool_call` then produces vLLM's shape for required tool choice:
a JSON array of one or more `{"name": NAME, "parameters": ARGS}` objects.
"""
from __future__ import annotations

import json as _json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionSpec:
    """One callable function: its name and the JSON schema of its arguments
    (None: any JSON object)."""
    name: str
    parameters: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("function name must be a non-empty string")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": self.parameters}


@dataclass(frozen=True)
class ToolCallConstraint:
    """The answer calls one of `functions` (tool_choice "required": every tool; a named
    tool_choice: that one). `required=False`: a call OR the format of the enclosing params
    (or, harmony without a format, free final text). `parallel=False` (the request's
    `parallel_tool_calls: false`): the non-harmony JSON list holds exactly one call (a harmony
    turn's constrained call is always one: `<|call|>` ends it)."""
    functions: tuple[FunctionSpec, ...]
    required: bool = True
    parallel: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "functions", tuple(
            f if isinstance(f, FunctionSpec) else FunctionSpec(**f) for f in self.functions))
        if not self.functions:
            raise ValueError("a tool-call constraint needs at least one function")
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate function names in {names}")

    def to_dict(self) -> dict[str, Any]:
        return {"functions": [f.to_dict() for f in self.functions], "required": self.required,
                "parallel": self.parallel}


_FORMATS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs` (json / regex / choice / grammar / json_object) plus a
    tool-call constraint and the harmony envelope. `grammar` is EBNF in the GBNF dialect
    (`root ::= ...`), as vLLM's default (xgrammar) backend and llama.cpp take it."""
    json: Mapping[str, Any] | str | None = field(default=None, hash=False)  # JSON schema
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    tool_call: ToolCallConstraint | None = None
    # JSON: allow free whitespace between tokens (off: compact, vLLM's disable_any_whitespace)
    any_whitespace: bool = False
    # the output is a harmony assistant turn (see the module docstring)
    harmony: bool = False
    # harmony: most tokens of the optional analysis message, as the request asks for it
    # (server/structured_hooks.with_budget; None: the engine's default; 0: no analysis
    # message); the engine caps it to leave room for the answer (manager.StructuredOutputs)
    analysis_budget: int | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.tool_call, Mapping):
            object.__setattr__(self, "tool_call", ToolCallConstraint(
                tuple(self.tool_call["functions"]), bool(self.tool_call.get("required", True)),
                bool(self.tool_call.get("parallel", True))))
        formats = self.formats()
        if len(formats) > 1:
            raise ValueError(f"only one of {', '.join(_FORMATS)} may be set, got {formats}")
        if self.tool_call is None and not formats:
            raise ValueError(f"structured outputs need one of {', '.join(_FORMATS)} "
                             "or a tool call")
        if self.tool_call is not None and self.tool_call.required and formats:
            raise ValueError("a required tool call cannot be combined with a response format")
        if self.choice is not None and (not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")
        if self.analysis_budget is not None and self.analysis_budget < 0:
            raise ValueError(f"analysis_budget must be non-negative, got {self.analysis_budget}")

    def formats(self) -> list[str]:
        """The names of the formats that are set (at most one after validation)."""
        values = {"json": self.json, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar, "json_object": self.json_object or None}
        return [k for k in _FORMATS if values[k] is not None]

    def json_schema(self) -> dict[str, Any] | None:
        """`json` as a dict (parsed when given as text); ValueError when it is not JSON."""
        if self.json is None or isinstance(self.json, Mapping):
            return None if self.json is None else dict(self.json)
        try:
            schema = _json.loads(self.json)
        except ValueError as e:
            raise ValueError(f"json schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):   # a user's input error, reported as a 400
            raise ValueError("json schema must be a JSON object")  # noqa: TRY004
        return schema

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (for frames between nodes); `from_dict` inverts it."""
        return {"json": self.json, "regex": self.regex,
                "choice": None if self.choice is None else list(self.choice),
                "grammar": self.grammar, "json_object": self.json_object,
                "tool_call": None if self.tool_call is None else self.tool_call.to_dict(),
                "any_whitespace": self.any_whitespace, "harmony": self.harmony,
                "analysis_budget": self.analysis_budget}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructuredOutputsParams:
        return cls(**d)

    def cache_key(self) -> str:
        """A stable text key: equal for equal constraints (the compile cache's key)."""
        return _json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

