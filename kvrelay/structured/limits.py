"""Bounds on what a request may hand the grammar engine, checked before anything compiles.

Owner: structured outputs (kvrelay/structured/). `check(p)` is called by the API server
(server/structured.py, before its isolated compile check) and by the engine
(`GrammarBackend.matcher`, before every compile: the offline API and every server path
reach it); the server's tool parsing calls `check_tools`. A violation is a GrammarError
whose message names the limit and its value (the server's 400 names the request field).

Why: llguidance (Rust) compiles recursively. A deep enough schema or grammar overflows
the thread's stack, which is a SIGSEGV that takes the whole process (measured: a 90 KB
`$ref` chain of 1,000 definitions, a Lark chain of 2,750 rules). Other inputs compile but
run away (CPU or memory) or fail at the first tokens. The checks here are pure Python,
linear in the input's size (a 256 KiB schema or grammar: tens of milliseconds), and never
recurse, so the checker itself cannot overflow.

The rule for every value: at most 1/8 of the smallest input measured to crash, run away
(> 1 s) or fail in llguidance on an 8 MiB stack (the main thread's default: the tightest a
compile can run on), and far above realistic agent schemas and grammars (hundreds of
properties, tens of `$defs`, nesting ~20; grammars of tens to a few hundred rules).
Measurements with llguidance 1.9.1; a compile with a 49k or o200k tokenizer and
`validate_grammar` without one crash at the same sizes within 10%:

- *Schema depth with `$ref`s followed* (`MAX_SCHEMA_EXPANDED_DEPTH`, JSON objects and
  arrays on the longest path; a `$ref` back into its own path is recursion and ends it):
  SIGSEGV from ~2,100 (arrays chained through `$ref`: 1,093 definitions × 2 levels);
  ~3,000 for object properties chained through `$ref` (1,000 × 3) or definitions nested
  inline and chained (27 × 111, 140 × 21); 2,500 for bare aliases. A 256 MiB stack (the
  engine's compile thread) moves this ~30× out. Inline nesting alone stops cleanly at
  128 JSON levels (serde's recursion limit): `MAX_SCHEMA_DEPTH` gives it a clear message.
- *Definitions* (`MAX_SCHEMA_DEFINITIONS`): an object of 2,000 `$ref`'d object properties
  compiles in 1.2 s with a tokenizer, 500 in 0.16 s; 10,000 is llguidance's own
  "schema too large". `MAX_SCHEMA_REFS` bounds the edges the depth check follows.
- *Grammar depth* (`MAX_GRAMMAR_DEPTH`: rules on the longest reference chain, each
  weighted by 1 + its group nesting at the reference; recursion ends a chain): SIGSEGV
  from 2,750 (a plain Lark chain), 3,750 (2 groups per rule), ~4,500 (20 groups per
  rule), 3,625 (GBNF). Group nesting within one rule stops cleanly at 29 (Lark).
- *Rules* (`MAX_GRAMMAR_RULES`): converting GBNF to Lark (Python, in llguidance) is
  quadratic: 500 rules 0.1 s, 1,000 0.6 s, 2,000 2 s, 3,500 5 s.
- *Alternatives of one rule, choices* (`MAX_ALTERNATIVES`, `MAX_CHOICES`): an Earley row
  holds at most 2,000 items, so from ~2,000 alternatives the matcher fails at the first
  tokens ("Current row has 2001 items"); compiling 32,000 choices takes 1 s, 128,000 23 s.
- *One choice's length* (`MAX_CHOICE_CHARS`): from ~150,000 characters the lexer fails
  at the first tokens ("too many expressions constructed").
- *Sizes* (`MAX_SCHEMA_BYTES`, `MAX_GRAMMAR_BYTES`, `MAX_REGEX_CHARS`,
  `MAX_TOOLS_SCHEMA_BYTES`): bound the checks' own cost and everything not measured one
  by one; a regex alternation stops cleanly at ~110,000 branches ("lexer too big").
- *Tools* (`MAX_TOOLS`): OpenAI's own limit (also the server's body check).

What these bounds do not cover (llguidance's own fuel limits, or a compile that is slow
for another reason: an integer `multipleOf` of 10^6 compiles in 7 s and 560 MB with a
tokenizer) is covered by where it compiles: the API server's check runs in a worker
process with a time budget (compile_check.py), the engine compiles on a thread with a
256 MiB stack (backend.py), and a matcher that fails while a request runs ends that
request with an error.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote

from kvrelay.structured.grammar import GrammarError
from kvrelay.structured.params import FunctionSpec, StructuredOutputsParams

# JSON schemas (one response format or one tool's parameters)
MAX_SCHEMA_BYTES = 256 * 1024            # as compact JSON
MAX_SCHEMA_DEPTH = 100                   # nested objects / arrays, $refs not followed
MAX_SCHEMA_EXPANDED_DEPTH = 256          # nested objects / arrays, $refs followed
MAX_SCHEMA_DEFINITIONS = 500             # entries of every $defs / definitions
MAX_SCHEMA_REFS = 2000                   # "$ref" keys
# Lark / GBNF grammars, choices, regexes
MAX_GRAMMAR_BYTES = 256 * 1024           # a grammar; also all choices together (UTF-8)
MAX_GRAMMAR_RULES = 500
MAX_GRAMMAR_DEPTH = 256                  # the longest rule chain, weighted by group nesting
MAX_ALTERNATIVES = 1000                  # `|` alternatives of one rule (nested groups' too)
MAX_CHOICES = 1000
MAX_CHOICE_CHARS = 10_000
MAX_REGEX_CHARS = 16 * 1024
# Counted repetitions multiplied through nested groups (`(a{300}){300}`: 90,000): in a
# regex, a schema's `pattern`, a grammar. llguidance's lexer unrolls them: a mask took
# 14 ms at 10,000 (a{10000}), 0.3-0.4 s at ~100,000, and past that it fails mid-request
# ("too many expressions constructed"). A schema's maxLength / maxItems are counters, not
# unrolled (1,000,000 cost nothing), and are not bounded.
MAX_REPEAT = 10_000
# tools
MAX_TOOLS = 128
MAX_TOOLS_SCHEMA_BYTES = 1024 * 1024     # all tools' parameters together

K = TypeVar("K", bound=Hashable)


class LimitExceeded(GrammarError):
    """A constraint over one of the bounds above; `limit` is the constant's name."""

    def __init__(self, what: str, found: str, limit: str, value: int) -> None:
        super().__init__(f"{what} {found}; the limit is {value:,} ({limit})")
        self.limit = limit


def check(p: StructuredOutputsParams) -> None:
    """LimitExceeded when any part of `p` is over a bound (GrammarError for a JSON
    schema given as text that does not parse)."""
    if p.json is not None:
        check_schema(p.json, "the JSON schema")
    if p.regex is not None:
        _at_most(len(p.regex), MAX_REGEX_CHARS, "MAX_REGEX_CHARS", "the regex", "characters")
        check_repeats(p.regex, "the regex")
    if p.choice is not None:
        check_choices(p.choice)
    if p.grammar is not None:
        check_grammar(p.grammar)
    if p.tool_call is not None:
        check_functions(p.tool_call.functions)


def check_tools(parameters: Sequence[tuple[str, Mapping[str, Any] | None]]) -> None:
    """The tools of a request, as (name, parameters schema): how many, their schemas
    together, and each schema."""
    _at_most(len(parameters), MAX_TOOLS, "MAX_TOOLS", "the request", "tools")
    total = 0
    for name, schema in parameters:
        if schema is not None:
            total += check_schema(schema, f"tool {name!r}: its parameters schema")
    _at_most(total, MAX_TOOLS_SCHEMA_BYTES, "MAX_TOOLS_SCHEMA_BYTES",
             "the tools' parameters schemas", "bytes of JSON together")


def check_functions(functions: Sequence[FunctionSpec]) -> None:
    check_tools([(f.name, f.parameters) for f in functions])


# -- JSON schemas ----------------------------------------------------------------------------
def check_schema(schema: Mapping[str, Any] | str, what: str) -> int:
    """Every bound on one JSON schema (a dict, or its JSON text); returns its size in
    bytes of compact JSON."""
    if isinstance(schema, str):
        size = len(schema.encode())
        _at_most(size, MAX_SCHEMA_BYTES, "MAX_SCHEMA_BYTES", what, "bytes")
        try:
            value = json.loads(schema)
        except RecursionError:
            raise LimitExceeded(what, "nests too deep to parse", "MAX_SCHEMA_DEPTH",
                                MAX_SCHEMA_DEPTH) from None
        except ValueError:
            return size                 # not JSON: the grammar builder reports it
    else:
        value = schema
        size = _json_size(value, what)
    if isinstance(value, Mapping | list):
        _check_schema_shape(value, what)
    return size


def _json_size(value: Any, what: str) -> int:
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise LimitExceeded(what, "nests too deep to serialise", "MAX_SCHEMA_DEPTH",
                            MAX_SCHEMA_DEPTH) from None
    except (TypeError, ValueError):
        return 0                        # not JSON: the grammar builder reports it
    size = len(text.encode())
    _at_most(size, MAX_SCHEMA_BYTES, "MAX_SCHEMA_BYTES", what, "bytes")
    return size


def _check_schema_shape(root: Any, what: str) -> None:
    """Inline depth, definitions and $refs in one pass; then the depth with $refs followed."""
    depth = definitions = refs = 0
    todo: list[tuple[Any, int]] = [(root, 1)]
    while todo:
        node, level = todo.pop()
        depth = max(depth, level)
        if isinstance(node, Mapping):
            if isinstance(node.get("$ref"), str):
                refs += 1
            if isinstance(node.get("pattern"), str):
                check_repeats(node["pattern"], f"{what}: a pattern")
            if isinstance(node.get("patternProperties"), Mapping):
                for pattern in node["patternProperties"]:
                    check_repeats(str(pattern), f"{what}: a patternProperties pattern")
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), Mapping):
                    definitions += len(node[key])
            children: Iterable[Any] = node.values()
        else:
            children = node
        todo.extend((c, level + 1) for c in children if isinstance(c, Mapping | list))
    _at_most(depth, MAX_SCHEMA_DEPTH, "MAX_SCHEMA_DEPTH", what, "levels of nesting")
    _at_most(definitions, MAX_SCHEMA_DEFINITIONS, "MAX_SCHEMA_DEFINITIONS", what,
             "definitions ($defs)")
    _at_most(refs, MAX_SCHEMA_REFS, "MAX_SCHEMA_REFS", what, "$refs")
    nodes: dict[int, Any] = {id(root): root}

    def edges(key: int) -> Iterator[tuple[int, int]]:
        node = nodes[key]
        children = list(node.values()) if isinstance(node, Mapping) else list(node)
        if isinstance(node, Mapping) and isinstance(node.get("$ref"), str):
            children.append(_resolve(root, node["$ref"]))
        for child in children:
            if isinstance(child, Mapping | list):
                nodes[id(child)] = child
                yield id(child), 0

    if _longest_path([id(root)], edges, MAX_SCHEMA_EXPANDED_DEPTH) is None:
        raise LimitExceeded(what, f"nests more than {MAX_SCHEMA_EXPANDED_DEPTH:,} levels deep "
                            "with its $refs followed", "MAX_SCHEMA_EXPANDED_DEPTH",
                            MAX_SCHEMA_EXPANDED_DEPTH)


def _resolve(root: Any, ref: str) -> Any:
    """The local target of a `$ref` ("#", "#/$defs/x", any JSON pointer); None when it
    is not local or does not resolve (llguidance reports those)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _longest_path(roots: Iterable[K], edges: Callable[[K], Iterable[tuple[K, int]]],
                  limit: int) -> int | None:
    """The heaviest path from any of `roots` (each node weighs 1, each edge its weight);
    an edge back into the current path (recursion) is not followed. None as soon as a
    path is over `limit`, so a deep input costs no more than `limit` steps down. No
    recursion: a stack of frames [node, its edges, the heaviest way down, weight so far]."""
    memo: dict[K, int] = {}
    on_path: set[K] = set()
    heaviest = 0
    for root in roots:
        if root in memo:
            continue
        stack: list[list[Any]] = [[root, iter(edges(root)), 0, 1, 0]]
        on_path.add(root)
        while stack:
            frame = stack[-1]
            step = next(frame[1], None)
            if step is not None:
                child, weight = step
                if child in on_path:
                    continue
                if child in memo:
                    below = weight + memo[child]
                    if frame[3] + below > limit:
                        return None
                    frame[2] = max(frame[2], below)
                    continue
                if frame[3] + weight + 1 > limit:
                    return None
                stack.append([child, iter(edges(child)), 0, frame[3] + weight + 1, weight])
                on_path.add(child)
                continue
            stack.pop()
            on_path.discard(frame[0])
            memo[frame[0]] = 1 + frame[2]
            if stack:
                stack[-1][2] = max(stack[-1][2], frame[4] + memo[frame[0]])
        heaviest = max(heaviest, memo[root])
    return heaviest


# -- choices ---------------------------------------------------------------------------------
def check_choices(choices: Sequence[str]) -> None:
    _at_most(len(choices), MAX_CHOICES, "MAX_CHOICES", "the choice list", "choices")
    longest = max((len(c) for c in choices), default=0)
    _at_most(longest, MAX_CHOICE_CHARS, "MAX_CHOICE_CHARS", "a choice", "characters")
    total = sum(len(c.encode()) for c in choices)
    _at_most(total, MAX_GRAMMAR_BYTES, "MAX_GRAMMAR_BYTES", "the choices", "bytes together")


# -- Lark / GBNF grammars --------------------------------------------------------------------
# What the rule scan removes first (it cannot hold rules, references or groups): Lark's
# strings, regexes, special tokens and // comments; GBNF's strings, classes and # comments
_LARK_LITERALS = re.compile(r'//[^\n]*|"(?:[^"\\\n]|\\.)*"i?|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*'
                            r"|<\|[^|\n]*\|>|<\[[^\]\n]*\]>")
_GBNF_LITERALS = re.compile(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]')
_LARK_HEAD = re.compile(r"(?m)^[ \t]*[?!]?([A-Za-z_]\w*)(?:\{[^}\n]*\})?(?:\.-?\d+)?"
                        r"(?:\[[^\]\n]*\])?[ \t]*:|^[ \t]*%")
_GBNF_HEAD = re.compile(r"(?m)^[ \t]*([A-Za-z_][\w-]*)[ \t]*::=")
_LARK_TOKENS = re.compile(r"[A-Za-z_]\w*|[()\[\]|]")
_GBNF_TOKENS = re.compile(r"[A-Za-z_][\w-]*|[()|]")
_EMBEDDED_JSON = re.compile(r"%(?:json|llguidance|regex)\s*(?=\{)")


def check_grammar(text: str) -> None:
    """Size, rules, alternatives per rule and depth of a Lark or GBNF grammar (the
    dialect as llguidance tells them apart); a schema embedded with Lark's `%json {...}`
    is checked as a schema. A scan, not a parse: what it cannot read, llguidance reports."""
    _at_most(len(text.encode()), MAX_GRAMMAR_BYTES, "MAX_GRAMMAR_BYTES", "the grammar", "bytes")
    check_repeats(text, "the grammar")        # its regex terminals and repetition ranges
    from llguidance.gbnf_to_lark import is_lark_syntax
    lark = is_lark_syntax(text)
    if lark:
        text = _blank_embedded_json(text)
    text = (_LARK_LITERALS if lark else _GBNF_LITERALS).sub(" ", text)
    rules = _rules(text, _LARK_HEAD if lark else _GBNF_HEAD)
    _at_most(len(rules), MAX_GRAMMAR_RULES, "MAX_GRAMMAR_RULES", "the grammar", "rules")
    tokens = _LARK_TOKENS if lark else _GBNF_TOKENS
    graph: dict[str, list[tuple[str, int]]] = {}
    for name, body in rules.items():
        _at_most(body.count("|") + 1, MAX_ALTERNATIVES, "MAX_ALTERNATIVES",
                 f"the grammar's rule {name!r}", "alternatives")
        graph[name] = _references(body, tokens, rules)
    if _longest_path(list(graph), graph.__getitem__, MAX_GRAMMAR_DEPTH) is None:
        raise LimitExceeded("the grammar", f"chains rules more than {MAX_GRAMMAR_DEPTH:,} "
                            "deep (each weighted by its group nesting)", "MAX_GRAMMAR_DEPTH",
                            MAX_GRAMMAR_DEPTH)


def _blank_embedded_json(text: str) -> str:
    """Lark's `%json {schema}` (and `%llguidance` / `%regex` options): each schema is
    checked as one, and every JSON body is blanked out before the rule scan."""
    decoder = json.JSONDecoder()
    pieces, at = [], 0
    for m in _EMBEDDED_JSON.finditer(text):
        if m.start() < at:
            continue
        try:
            value, end = decoder.raw_decode(text, m.end())
        except RecursionError:
            raise LimitExceeded("a %json schema in the grammar", "nests too deep to parse",
                                "MAX_SCHEMA_DEPTH", MAX_SCHEMA_DEPTH) from None
        except ValueError:
            continue                    # llguidance reports it
        if m.group().startswith("%json"):
            check_schema(value, "a %json schema in the grammar")
        pieces += [text[at:m.end()], " " * (end - m.end())]
        at = end
    return "".join(pieces) + text[at:]


def _rules(text: str, head: re.Pattern[str]) -> dict[str, str]:
    """{rule name: its body} (a name defined twice: its bodies joined)."""
    heads = list(head.finditer(text))
    rules: dict[str, str] = {}
    for m, nxt in zip(heads, [*heads[1:], None]):
        if m.group(1) is None:              # a Lark directive (%import, %ignore, ...)
            continue
        body = text[m.end():nxt.start() if nxt is not None else len(text)]
        rules[m.group(1)] = rules.get(m.group(1), "") + " | " * (m.group(1) in rules) + body
    return rules


def _references(body: str, tokens: re.Pattern[str], rules: Mapping[str, str],
                ) -> list[tuple[str, int]]:
    """The rules `body` refers to, each with the group nesting where it does."""
    refs: list[tuple[str, int]] = []
    level = 0
    for tok in tokens.findall(body):
        if tok in "([":
            level += 1
        elif tok in ")]":
            level = max(level - 1, 0)
        elif tok != "|" and tok in rules:
            refs.append((tok, level))
    return refs


_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_repeats(text: str, what: str) -> None:
    """LimitExceeded when `text` (a regex, or a grammar's text) repeats something more
    than MAX_REPEAT times, counted repetitions (`{n}`, `{n,m}`, `{n,}`, Lark's `~ n..m`)
    multiplied through the groups they apply to."""
    _at_most(repeat_product(text), MAX_REPEAT, "MAX_REPEAT", what,
             "repetitions (counted repetitions multiplied through nested groups)")


def repeat_product(text: str) -> int:
    """The largest product of counted repetitions that apply to one atom, in one pass (no
    recursion): `(a{300}){300}` → 90,000; `a{10}b{20}` → 20. Escapes and character classes
    are single atoms; a quantifier applies to the atom or group just before it."""
    groups = [1]                  # the largest product inside each open group
    last = best = 1               # the value the next quantifier multiplies
    i = 0
    while i < len(text):
        c = text[i]
        if c == "(":
            groups.append(1)
            last, i = 1, i + 1
            continue
        if c == ")":
            last = groups.pop() if len(groups) > 1 else 1
            groups[-1] = max(groups[-1], last)
            i += 1
            continue
        m = _QUANTIFIER.match(text, i)
        if m:
            low, high = int(m.group(1) or m.group(3)), m.group(2) or m.group(4)
            last *= max(low, int(high) if high else 0, 1)
            groups[-1], best = max(groups[-1], last), max(best, last)
            i = m.end()
            continue
        if c == "[":
            i = _class_end(text, i)
        else:
            i += 2 if c == "\\" else 1
        last = 1
    return max(best, *groups)


def _class_end(text: str, i: int) -> int:
    """The index after the character class that starts at text[i] == "["."""
    i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _at_most(value: int, limit: int, name: str, what: str, unit: str) -> None:
    if value > limit:
        raise LimitExceeded(what, f"has {value:,} {unit}", name, limit)
