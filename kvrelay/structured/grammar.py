"""StructuredOutputsParams → an llguidance grammar (torch-free).

The result is llguidance's JSON grammar list: a top-level Lark grammar that names the
pieces by reference (`@body`, `@args_0`, …) and one sub-grammar per piece (a JSON schema,
or Lark for regex / choice / EBNF). References keep a user's grammar out of our rule
namespace, and let the harmony envelope (special tokens, the analysis budget) wrap any
format unchanged:

    start: analysis? answer                        (no `analysis` when the budget is 0)
    analysis: <|channel|> "analysis" <|message|> think <|end|> <|start|> "assistant"
    think[max_tokens=B]: /(.|\\n)*/                (free text, no special tokens)
    answer: final | call_0 | call_1 …
    final: <|channel|> "final" <|message|> @body <|return|>
    call_i: <|channel|> "commentary to=functions.NAME_i " <|constrain|> "json"
            <|message|> @args_i <|call|>
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvrelay.structured.params import StructuredOutputsParams, ToolCallConstraint


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar)."""


def _json_options(p: StructuredOutputsParams) -> dict[str, Any]:
    if p.any_whitespace:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _with_options(schema: Mapping[str, Any], p: StructuredOutputsParams) -> dict[str, Any]:
    """The schema with our whitespace options (the caller's own x-guidance keys win)."""
    out = dict(schema)
    out["x-guidance"] = _json_options(p) | dict(schema.get("x-guidance") or {})
    return out


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _format_grammar(p: StructuredOutputsParams) -> dict[str, Any] | None:
    """The answer's format as one llguidance grammar entry (without a name), or None."""
    if p.json is not None or p.json_object:
        schema = p.json_schema() if p.json is not None else {"type": "object"}
        if not isinstance(schema, Mapping):
            raise GrammarError("the JSON schema must be an object")
        return {"json_schema": _with_options(schema, p)}
    if p.regex is not None:
        import llguidance
        return {"lark_grammar": f"start: /{llguidance.regex_to_lark(p.regex)}/"}
    if p.choice is not None:
        return {"lark_grammar": "start: " + " | ".join(_lark_string(c) for c in p.choice)}
    if p.grammar is not None:
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            return {"lark_grammar": any_to_lark(p.grammar)}
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exception on bad EBNF
            raise GrammarError(f"grammar: {e}") from None
    return None


def _args_schema(parameters: Mapping[str, Any] | None, p: StructuredOutputsParams) -> dict:
    return _with_options(parameters if parameters else {"type": "object"}, p)


def _calls_schema(tools: ToolCallConstraint, p: StructuredOutputsParams) -> dict[str, Any]:
    """Non-harmony tool calls: vLLM's required-tool-choice shape, a JSON array of
    `{"name": NAME, "parameters": ARGS}` (exactly one under `parallel=False`). Each
    function's schema sits in `$defs` as `fn_I`, its own `$ref`s moved below it, so they
    resolve as in the schema alone."""
    defs = {f"fn_{i}": _relocated(f.parameters or {"type": "object"}, f"#/$defs/fn_{i}")
            for i, f in enumerate(tools.functions)}
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                "properties": {"name": {"const": f.name},
                               "parameters": {"$ref": f"#/$defs/fn_{i}"}}}
               for i, f in enumerate(tools.functions)]
    item = options[0] if len(options) == 1 else {"anyOf": options}
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": item, "$defs": defs}
    if not tools.parallel:
        array["maxItems"] = 1
    return _with_options(array, p)


def _relocated(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#", "#/$defs/x", ...) point below `base`,
    where it is embedded. Recursive: limits.py bounds the nesting (MAX_SCHEMA_DEPTH)."""
    if isinstance(schema, list):
        return [_relocated(v, base) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _relocated(v, base) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def build_grammar(p: StructuredOutputsParams, analysis_budget: int = 0) -> str:
    """The llguidance grammar (JSON text) for `p`; GrammarError for a malformed format."""
    if p.harmony:
        return json.dumps({"grammars": _harmony_grammars(p, analysis_budget)})
    fmt = _format_grammar(p)
    if p.tool_call is not None and fmt is None:
        fmt = {"json_schema": _calls_schema(p.tool_call, p)}
    elif p.tool_call is not None and fmt is not None:     # a formatted answer or the calls
        calls = {"name": "calls", "json_schema": _calls_schema(p.tool_call, p)}
        return json.dumps({"grammars": [{"lark_grammar": "start: @body | @calls"},
                                        {"name": "body", **fmt}, calls]})
    assert fmt is not None, "StructuredOutputsParams validates that a format is set"
    return json.dumps({"grammars": [fmt]})


def _harmony_grammars(p: StructuredOutputsParams, budget: int) -> list[dict[str, Any]]:
    rules = ["start: analysis? answer" if budget > 0 else "start: answer"]
    if budget > 0:
        rules += ['analysis: <|channel|> "analysis" <|message|> think <|end|> '
                  '<|start|> "assistant"',
                  f"think[max_tokens={budget}]: /(.|\\n)*/"]
    answers, subs = [], []
    fmt = _format_grammar(p)
    if fmt is not None:
        answers.append("final")
        rules.append('final: <|channel|> "final" <|message|> @body <|return|>')
        subs.append({"name": "body", **fmt})
    elif p.tool_call is None or not p.tool_call.required:
        answers.append("final")
        rules.append('final: <|channel|> "final" <|message|> /(.|\\n)*/ <|return|>')
    for i, f in enumerate(p.tool_call.functions if p.tool_call else ()):
        header = _lark_string(f"commentary to=functions.{f.name} ")
        answers.append(f"call_{i}")
        rules.append(f'call_{i}: <|channel|> {header} <|constrain|> "json" <|message|> '
                     f"@args_{i} <|call|>")
        subs.append({"name": f"args_{i}", "json_schema": _args_schema(f.parameters, p)})
    rules.insert(1, "answer: " + " | ".join(answers))
    return [{"lark_grammar": "\n".join(rules)}, *subs]
