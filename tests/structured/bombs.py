"""Hostile constraints (each measured to crash, run away or fail in llguidance when
unbounded: kvrelay/structured/limits.py) and realistic ones that must keep passing."""
from __future__ import annotations

from typing import Any


def ref_chain(n: int) -> dict[str, Any]:
    """Issue 26's schema: object properties chained through n `$defs` (SIGSEGV at ~1,000)."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object",
                                      "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
                            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def alias_chain(n: int) -> dict[str, Any]:
    """n definitions, each only a `$ref` to the next: expanded depth n + 3 (the root, the
    `$defs` object, n aliases, the string)."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_defs_chain(n: int, depth: int) -> dict[str, Any]:
    """n definitions chained, each `depth` objects deep inline (SIGSEGV at 27 × 55)."""
    defs: dict[str, Any] = {}
    for i in range(n):
        schema: dict[str, Any] = {"$ref": f"#/$defs/d{i + 1}"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        defs[f"d{i}"] = schema
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    """start → r0 → r1 → … → rn: n + 2 rules deep (SIGSEGV at ~2,750)."""
    rules = [f'r{i}: r{i + 1} "a"' for i in range(n)] + [f'r{n}: "b"']
    return "start: r0\n" + "\n".join(rules)


def gbnf_chain(n: int) -> str:
    """The GBNF twin of `lark_chain` (SIGSEGV at ~3,600; 5 s to convert at 3,500)."""
    rules = [f'r{i} ::= r{i + 1} "a"' for i in range(n)] + [f'r{n} ::= "b"']
    return "root ::= r0\n" + "\n".join(rules)


def lark_wide(n: int) -> str:
    """start and n rules it uses side by side: n + 1 rules, 2 deep."""
    return "start: " + " ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(
        f'r{i}: "a{i}"' for i in range(n))


def alternatives(n: int) -> str:
    return "root ::= " + " | ".join(f'"alt{i}"' for i in range(n))


def choices(n: int) -> list[str]:
    return [f"choice number {i}" for i in range(n)]


def embedded_json_grammar(schema: dict[str, Any]) -> str:
    """A Lark grammar that embeds a JSON schema (llguidance's `%json {...}`)."""
    import json
    return f"start: %json {json.dumps(schema)}\n"


# -- realistic constraints that must pass -------------------------------------------------------
def agent_schema() -> dict[str, Any]:
    """An agent's big schema: 300 properties, 30 `$defs` (one recursive), nesting 20."""
    defs: dict[str, Any] = {
        f"Def{i}": {"type": "object", "description": f"definition {i} " * 5,
                    "properties": {"id": {"type": "string"}, "n": {"type": "integer"},
                                   "next": {"$ref": f"#/$defs/Def{i + 1}"} if i < 28
                                   else {"type": "null"}},
                    "required": ["id"]}
        for i in range(29)}
    defs["Tree"] = {"type": "object", "properties": {
        "value": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Tree"}}}}
    deep: dict[str, Any] = {"type": "string"}
    for level in range(20):
        deep = {"type": "object", "properties": {f"level{level}": deep}}
    props: dict[str, Any] = {f"field_{i}": {"type": ["string", "integer"][i % 2],
                                            "description": "a field of the agent's form"}
                             for i in range(296)}
    props |= {"deep": deep, "tree": {"$ref": "#/$defs/Tree"}, "chain": {"$ref": "#/$defs/Def0"},
              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}
    return {"type": "object", "properties": props, "required": ["field_0"], "$defs": defs}


ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?   # a comment with | and ( in it
"""

LIST_LARK = r"""
start: "[" item ("," item)* "]"
item: NUMBER | STRING | "true" | "false" | "null"
NUMBER: /-?[0-9]+/
STRING: /"[^"|(]*"/
"""
