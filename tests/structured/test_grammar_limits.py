"""The bounds on constraints (kvrelay/structured/limits.py): each limit at its value passes
and one past it is a GrammarError naming the limit and its value; the inputs measured to
crash or run away llguidance are refused in milliseconds, without llguidance; realistic
agent schemas and grammars pass (the engine's side: test_grammar_failure.py)."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest

from kvrelay.structured import limits
from kvrelay.structured.grammar import GrammarError
from kvrelay.structured.limits import LimitExceeded
from kvrelay.structured.params import FunctionSpec, ToolCallConstraint
from kvrelay.structured.params import StructuredOutputsParams as Constraint
from tests.structured import bombs


def _sized_schema(size: int) -> dict[str, Any]:
    """A schema whose compact JSON is exactly `size` bytes."""
    base = {"type": "string", "description": ""}
    pad = size - len(json.dumps(base, separators=(",", ":")))
    return {"type": "string", "description": "x" * pad}


def _nested(depth: int) -> dict[str, Any]:
    """`depth` nested objects (JSON containers), $refs not involved."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def _definitions(n: int) -> dict[str, Any]:
    return {"type": "string", "$defs": {f"d{i}": {"type": "string"} for i in range(n)}}


def _refs(n: int) -> dict[str, Any]:
    return {"type": "object", "$defs": {"s": {"type": "string"}},
            "properties": {f"p{i}": {"$ref": "#/$defs/s"} for i in range(n)}}


def _tools(sizes: list[int]) -> ToolCallConstraint:
    return ToolCallConstraint(tuple(FunctionSpec(f"f{i}", _sized_schema(s))
                                    for i, s in enumerate(sizes)))


S = limits.MAX_SCHEMA_BYTES
# (limit, a constraint at the limit, one just past it)
BOUNDARIES = [
    ("MAX_SCHEMA_BYTES", Constraint(json=_sized_schema(S)), Constraint(json=_sized_schema(S + 1))),
    ("MAX_SCHEMA_BYTES", Constraint(json=json.dumps(_sized_schema(S), separators=(",", ":"))),
     Constraint(json=json.dumps(_sized_schema(S + 1), separators=(",", ":")))),
    ("MAX_SCHEMA_DEPTH", Constraint(json=_nested(100)), Constraint(json=_nested(101))),
    ("MAX_SCHEMA_EXPANDED_DEPTH", Constraint(json=bombs.alias_chain(253)),
     Constraint(json=bombs.alias_chain(254))),
    ("MAX_SCHEMA_DEFINITIONS", Constraint(json=_definitions(500)),
     Constraint(json=_definitions(501))),
    ("MAX_SCHEMA_REFS", Constraint(json=_refs(2000)), Constraint(json=_refs(2001))),
    ("MAX_GRAMMAR_BYTES", Constraint(grammar='start: "' + "a" * (2**18 - 9) + '"'),
     Constraint(grammar='start: "' + "a" * (2**18 - 8) + '"')),
    ("MAX_GRAMMAR_RULES", Constraint(grammar=bombs.lark_wide(499)),
     Constraint(grammar=bombs.lark_wide(500))),
    ("MAX_GRAMMAR_DEPTH", Constraint(grammar=bombs.lark_chain(254)),
     Constraint(grammar=bombs.lark_chain(255))),
    ("MAX_GRAMMAR_DEPTH", Constraint(grammar=bombs.gbnf_chain(254)),
     Constraint(grammar=bombs.gbnf_chain(255))),
    ("MAX_ALTERNATIVES", Constraint(grammar=bombs.alternatives(1000)),
     Constraint(grammar=bombs.alternatives(1001))),
    ("MAX_CHOICES", Constraint(choice=bombs.choices(1000)),
     Constraint(choice=bombs.choices(1001))),
    ("MAX_CHOICE_CHARS", Constraint(choice=["x" * 10_000, "y"]),
     Constraint(choice=["x" * 10_001, "y"])),
    ("MAX_GRAMMAR_BYTES", Constraint(choice=["x" * 8192] * 32),
     Constraint(choice=["x" * 8192] * 32 + ["y"])),
    ("MAX_REGEX_CHARS", Constraint(regex="a" * 16384), Constraint(regex="a" * 16385)),
    ("MAX_TOOLS", Constraint(tool_call=_tools([40] * 128)),
     Constraint(tool_call=_tools([40] * 129))),
    ("MAX_TOOLS_SCHEMA_BYTES", Constraint(tool_call=_tools([S] * 4)),
     Constraint(tool_call=_tools([S] * 4 + [40]))),
]


@pytest.mark.parametrize("name,at_limit,past_it", BOUNDARIES,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BOUNDARIES)])
def test_each_limit_passes_at_its_value_and_refuses_one_past_it(name, at_limit, past_it):
    value = getattr(limits, name)
    limits.check(at_limit)
    with pytest.raises(LimitExceeded) as e:
        limits.check(past_it)
    assert e.value.limit == name
    assert isinstance(e.value, GrammarError) and isinstance(e.value, ValueError)
    assert name in str(e.value) and f"{value:,}" in str(e.value)


@pytest.mark.parametrize("name,constraint", [
    ("MAX_SCHEMA_DEFINITIONS", Constraint(json=bombs.ref_chain(1200))),       # issue 26
    ("MAX_SCHEMA_EXPANDED_DEPTH", Constraint(json=bombs.ref_chain(300))),
    ("MAX_SCHEMA_DEPTH", Constraint(json=bombs.nested_defs_chain(27, 55))),
    ("MAX_SCHEMA_EXPANDED_DEPTH", Constraint(json=bombs.nested_defs_chain(140, 10))),
    ("MAX_SCHEMA_DEFINITIONS", Constraint(json=bombs.alias_chain(2500))),
    ("MAX_SCHEMA_DEPTH", Constraint(json="[" * 100_000 + "]" * 100_000)),
    ("MAX_GRAMMAR_RULES", Constraint(grammar=bombs.lark_chain(3000))),
    ("MAX_GRAMMAR_RULES", Constraint(grammar=bombs.gbnf_chain(5000))),
    ("MAX_GRAMMAR_DEPTH", Constraint(grammar=bombs.lark_chain(400))),
    ("MAX_SCHEMA_EXPANDED_DEPTH",
     Constraint(grammar=bombs.embedded_json_grammar(bombs.ref_chain(300)))),
    ("MAX_CHOICES", Constraint(choice=bombs.choices(10_000))),
    ("MAX_ALTERNATIVES", Constraint(grammar=bombs.alternatives(20_000))),
    ("MAX_CHOICE_CHARS", Constraint(choice=["x" * 10**6, "y"])),
    ("MAX_SCHEMA_EXPANDED_DEPTH", Constraint(tool_call=ToolCallConstraint(
        (FunctionSpec("ok", {"type": "object"}), FunctionSpec("bomb", bombs.ref_chain(300)))))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_measured_bombs_are_refused_cheaply(name, constraint):
    start = time.perf_counter()
    with pytest.raises(LimitExceeded) as e:
        limits.check(constraint)
    assert e.value.limit == name
    assert time.perf_counter() - start < 1.0          # tens of ms; generous for a busy CI


def test_messages_name_the_part_and_the_tool():
    with pytest.raises(LimitExceeded, match="tool 'bomb': its parameters schema nests more"):
        limits.check(Constraint(tool_call=ToolCallConstraint(
            (FunctionSpec("bomb", bombs.ref_chain(300)),))))
    with pytest.raises(LimitExceeded, match="the grammar's rule 'root' has 20,000 alternatives"):
        limits.check(Constraint(grammar=bombs.alternatives(20_000)))


@pytest.mark.parametrize("constraint", [
    Constraint(json=bombs.agent_schema()),
    Constraint(json=json.dumps(bombs.agent_schema())),
    Constraint(tool_call=ToolCallConstraint(tuple(FunctionSpec(f"tool_{i}", bombs.agent_schema())
                                                  for i in range(3)))),
    Constraint(grammar=bombs.ARITHMETIC_GBNF),
    Constraint(grammar=bombs.LIST_LARK),
    Constraint(choice=["red", "green", "blue"]),
    Constraint(regex=r"[A-Z]{2}-[0-9]{3}"),
    Constraint(json_object=True),
], ids=["agent-schema", "agent-schema-text", "agent-tools", "gbnf", "lark", "choice", "regex",
        "json-object"])
def test_realistic_constraints_pass_and_compile(constraint):
    from kvrelay.structured.backend import validate
    limits.check(constraint)
    validate(constraint)                      # and llguidance compiles them


def test_recursion_is_not_depth():
    """A recursive schema ($ref back into its own path) and a recursive grammar are fine."""
    tree = {"$ref": "#", "type": "object"}
    limits.check(Constraint(json={"type": "object", "properties": {"kids": {
        "type": "array", "items": {"$ref": "#"}}}}))
    limits.check(Constraint(json=tree))
    limits.check(Constraint(grammar="start: item\nitem: \"(\" item \")\" | \"x\""))


def test_a_schema_text_that_is_not_json_is_left_to_the_grammar_builder():
    limits.check(Constraint(json="{not json"))      # no LimitExceeded: backend says why


@pytest.mark.parametrize("text, product", [
    ("(a{300}){300}", 90_000), ("a{10}b{20}", 20), ("x{2,}", 2), ("x{2,7}", 7),
    ("((a{10}){10}){10}", 1000), ("(a{5})(b{7}){2}", 14), ("[{}]{5}", 5), (r"\{3}", 1),
    (r"\d{1,1000}", 1000), ('r: "a"~3..50', 50), ("plain (text)", 1)])
def test_repeat_product_multiplies_counted_repetitions_through_groups(text, product):
    assert limits.repeat_product(text) == product


@pytest.mark.parametrize("make", [
    lambda rx: Constraint(regex=rx),
    lambda rx: Constraint(json={"type": "string", "pattern": rx}),
    lambda rx: Constraint(json={"type": "object", "patternProperties": {rx: {}}}),
    lambda rx: Constraint(grammar=f"start: /{rx}/"),
])
def test_counted_repetitions_are_bounded_where_a_regex_arrives(make):
    """`(a{1000}){1000}` passed every other bound, compiled, took 1.5 s per mask and then
    failed mid-request ("too many expressions constructed"): the hostile battery's 500."""
    limits.check(make("(a{100}){100}"))                              # 10,000: at the limit
    for rx in ("(a{1000}){1000}", "(a{100}){101}", "a{10001}"):
        with pytest.raises(LimitExceeded) as e:
            limits.check(make(rx))
        assert e.value.limit == "MAX_REPEAT"


def test_schema_lengths_are_counters_not_repetitions():
    limits.check(Constraint(json={"type": "string", "maxLength": 10**6, "minLength": 10**5}))
    limits.check(Constraint(json={"type": "array", "maxItems": 10**6}))
