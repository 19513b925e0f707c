"""Structured-output request fields → StructuredOutputsParams, checked before the engine.

Accepted (at most one per request):
- OpenAI `response_format`: {"type": "text" | "json_object"} or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
- vLLM `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object",
  optional "disable_any_whitespace"}
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (and `guided_whitespace_pattern` only as absent/None).

A malformed field, schema, regex or grammar is a 400 naming the field and the problem.
JSON is compact by default (no free whitespace), as vLLM's disable_any_whitespace.

Every constraint the server hands the engine — these fields, tool choice, the Responses
API's `text.format` (server/structured_hooks.py) — passes `check_constraint`
(server/grammar_check.py): the bounds, then one compile in a worker process.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrelay.server.grammar_check import check_constraint
from kvrelay.server.protocol import OpenAIError
from kvrelay.structured.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def request_constraint(body: Any, harmony: bool = False) -> StructuredOutputsParams | None:
    """The request's output constraint (None without one); OpenAIError (400) when a field is
    malformed or its schema / regex / grammar does not compile. `harmony`: the prompt is a
    harmony chat, so the constraint covers the whole assistant turn."""
    found = [(name, fields) for name, fields in _sources(body) if fields is not None]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise OpenAIError(f"give only one of response_format, structured_outputs and guided_*; "
                          f"got {names}", param=found[1][0])
    param, fields = found[0]
    try:
        p = StructuredOutputsParams(harmony=harmony, **fields)
    except (TypeError, ValueError) as e:
        raise OpenAIError(f"{param}: {e}", param=param) from None
    check_constraint(p, param)
    return p


def _sources(body: Any) -> list[tuple[str, dict[str, Any] | None]]:
    guided = {k: getattr(body, k) for k in _GUIDED if getattr(body, k, None) is not None}
    return [("response_format", _response_format(getattr(body, "response_format", None))),
            ("structured_outputs", _vllm_fields(getattr(body, "structured_outputs", None))),
            (next(iter(guided), "guided_json"),
             {_GUIDED[k]: v for k, v in guided.items()} or None)]


def _response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
        raise OpenAIError("response_format must be an object with a \"type\"",
                          param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise OpenAIError(f"response_format.type: expected text, json_object or json_schema, "
                          f"got {kind!r}", param="response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise OpenAIError("response_format.json_schema must be an object with a \"name\"",
                          param="response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})   # OpenAI: a schema-less format is any object
    if not isinstance(schema, Mapping):
        raise OpenAIError("response_format.json_schema.schema must be a JSON object",
                          param="response_format.json_schema.schema")
    return {"json": dict(schema)}


def _vllm_fields(so: Any) -> dict[str, Any] | None:
    if so is None:
        return None
    if not isinstance(so, Mapping):
        raise OpenAIError("structured_outputs must be an object", param="structured_outputs")
    fields = {k: so[k] for k in _VLLM_KEYS if so.get(k) not in (None, False)}
    if not fields:
        raise OpenAIError(f"structured_outputs needs one of {', '.join(_VLLM_KEYS)}",
                          param="structured_outputs")
    for key, types in (("json", (Mapping, str)), ("regex", str), ("grammar", str),
                       ("choice", list), ("json_object", bool)):
        if key in fields and not isinstance(fields[key], types):
            raise OpenAIError(f"structured_outputs.{key} has the wrong type "
                              f"({type(fields[key]).__name__})", param=f"structured_outputs.{key}")
    if "disable_any_whitespace" in so and not so["disable_any_whitespace"]:
        fields["any_whitespace"] = True
    return fields


def is_harmony_chat(chat: Any) -> bool:
    """Whether chat requests render harmony (the constraint then covers the whole turn)."""
    from kvrelay.server.harmony_chat import HarmonyChat
    return isinstance(chat, HarmonyChat)
