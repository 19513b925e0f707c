"""Enforcement that always finishes (kvrelay/structured/closing.py, manager.py): the analysis
budget stops the analysis at exactly its budget, and a harmony turn under a grammar ends
within max_tokens however the model chooses — here a scripted chooser that never closes
anything it may keep open. Fast: a 268-token byte-level tokenizer with harmony's markers."""
from __future__ import annotations

import json
import random
from collections.abc import Callable

import jsonschema
import numpy as np
import pytest

from kvrelay.sampling_params import SamplingParams
from kvrelay.structured.backend import GrammarBackend, GrammarMatcher
from kvrelay.structured.closing import GROWTH
from kvrelay.structured.manager import StructuredOutputs, effort_budget, requested_budget
from kvrelay.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallConstraint

MARKERS = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
           "<|call|>")
MERGES = (('"', "}"), ('"', '"'), ("{", '"'), ('"', ":"))
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
NESTED = {"type": "object", "required": ["n", "rows"], "additionalProperties": False,
          "properties": {"n": {"type": "integer"}, "rows": {"type": "array", "items": {
              "type": "object", "required": ["k", "v"], "additionalProperties": False,
              "properties": {"k": {"type": "string"}, "v": {"enum": ["yes", "no"]}}}}}}


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (printable bytes stand for
    themselves, the others move to 256 and up)."""
    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out, extra = {}, 0
    for b in range(256):
        out[b] = chr(b) if b in keep else chr(256 + extra)
        extra += b not in keep
    return out


def tiny_tokenizer_json() -> str:
    """Every byte a token, a few JSON merges, then harmony's markers as special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    merges = []
    for a, b in MERGES:
        left, right = ("".join(chars[x] for x in s.encode()) for s in (a, b))
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return tok.to_str()


@pytest.fixture(scope="module")
def structured() -> StructuredOutputs:
    from tokenizers import Tokenizer

    class _Tok:                          # what StructuredOutputs reads of a checkpoint's
        tokenizer = Tokenizer.from_str(tiny_tokenizer_json())
    so = StructuredOutputs(_Tok(), _Tok.tokenizer.get_vocab_size(), ())  # type: ignore[arg-type]
    return so


def _id(backend: GrammarBackend, text: str) -> int:
    (token,) = backend.tokenizer.tokenize_str(text, parse_special=text.startswith("<|"))
    return token


def _call(schema: dict, **kw: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(tool_call=ToolCallConstraint((FunctionSpec("f", schema),)),
                                   harmony=True, **kw)


def _allowed(m: GrammarMatcher) -> list[int]:
    """The next mask, filled as the engine fills it (one-hot while an ending is taken)."""
    words = (m.backend.vocab_size + 31) // 32
    mask = np.zeros((1, words), dtype=np.int32)
    m.backend.fill([(m, 0)], mask.ctypes.data, 1, parallel=False)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:m.backend.vocab_size]
    return [int(t) for t in np.flatnonzero(bits)]


def stubborn(backend: GrammarBackend) -> Callable[[list[int]], int]:
    """A model that keeps everything open: more text, more digits, more items, and the
    grammar's own ending only when nothing else is allowed."""
    keep_going = [_id(backend, c) for c in ("a", "1", ",", "[", "{")]

    def choose(allowed: list[int]) -> int:
        return next((t for t in keep_going if t in allowed), allowed[0])
    return choose


def generate(m: GrammarMatcher, choose: Callable[[list[int]], int], max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens and not m.terminated:
        allowed = _allowed(m)
        assert allowed, "the grammar allowed nothing"
        token = choose(allowed)
        assert m.allows(token)
        m.accept(token)
        assert m.failed is None, m.failed
        out.append(token)
    return out


def _split(backend: GrammarBackend, out: list[int]) -> tuple[list[int], str, str]:
    """(analysis text tokens, the call's header, its arguments) of a harmony turn."""
    message, end, call = (_id(backend, t) for t in ("<|message|>", "<|end|>", "<|call|>"))
    analysis: list[int] = []
    if out.count(message) == 2:
        analysis = out[out.index(message) + 1:out.index(end)]
        out = out[out.index(end) + 1:]
    assert out[-1] == call, backend.tokenizer.decode_str(out)
    header = out[:out.index(message)]
    return analysis, backend.tokenizer.decode_str(header), \
        backend.tokenizer.decode_str(out[out.index(message) + 1:-1])


def _matcher(so: StructuredOutputs, p: StructuredOutputsParams, max_tokens: int) -> GrammarMatcher:
    m = so.matcher(SamplingParams(max_tokens=max_tokens, structured_outputs=p))
    assert m is not None
    return m


@pytest.mark.parametrize("budget", [1, 7, 20])
def test_a_budget_of_n_stops_the_analysis_at_exactly_n_tokens_then_the_call(structured, budget):
    m = _matcher(structured, _call(CITY, analysis_budget=budget), 400)
    out = generate(m, stubborn(m.backend), 400)
    analysis, header, args = _split(m.backend, out)
    assert len(analysis) == budget and set(analysis) == {_id(m.backend, "a")}
    assert "commentary to=functions.f" in header
    jsonschema.validate(json.loads(args), CITY)


def test_the_analysis_ends_with_its_budget_not_before(structured):
    """After n-1 analysis tokens text is still allowed; after n only `<|end|>` is."""
    backend = structured.backend
    m = _matcher(structured, _call(CITY, analysis_budget=3), 400)
    for text in ("<|channel|>", *"analysis", "<|message|>", "a", "a"):
        m.accept(_id(backend, text))
    assert m.allows(_id(backend, "a"))
    m.accept(_id(backend, "a"))
    assert _allowed(m) == [_id(backend, "<|end|>")]


@pytest.mark.parametrize("schema", [CITY, NESTED], ids=["string", "nested"])
@pytest.mark.parametrize("max_tokens", [80, 128, 200])
def test_a_call_that_never_closes_is_closed_within_max_tokens(structured, schema, max_tokens):
    m = _matcher(structured, _call(schema), max_tokens)
    out = generate(m, stubborn(m.backend), max_tokens)
    assert m.terminated and len(out) <= max_tokens
    _, _, args = _split(m.backend, out)
    jsonschema.validate(json.loads(args), schema)


def test_a_formatted_answer_that_never_closes_is_closed_within_max_tokens(structured):
    p = StructuredOutputsParams(json=NESTED, harmony=True)
    m = _matcher(structured, p, 90)
    out = generate(m, stubborn(m.backend), 90)
    assert m.terminated and out[-1] == _id(m.backend, "<|return|>")
    text = m.backend.tokenizer.decode_str(out)
    jsonschema.validate(json.loads(text.split("<|message|>")[-1][:-len("<|return|>")]), NESTED)


@pytest.mark.parametrize("seed", range(8))
def test_random_choices_always_finish(structured, seed):
    """Any allowed token at each step (the random-weight model's case): every run ends with
    a schema-valid call within max_tokens."""
    rng = random.Random(seed)
    m = _matcher(structured, _call(NESTED), 60 + 10 * seed)
    # (not the NUL byte, token 0: llguidance's mask lets it into free text, its lexer not)
    out = generate(m, lambda allowed: rng.choice([t for t in allowed if t]), 60 + 10 * seed)
    assert m.terminated
    jsonschema.validate(json.loads(_split(m.backend, out)[2]), NESTED)


def test_the_ending_is_taken_as_late_as_the_margin_allows(structured):
    """A free string runs until the ending plus GROWTH tokens would no longer fit."""
    m = _matcher(structured, _call(CITY, analysis_budget=0), 100)
    out = generate(m, stubborn(m.backend), 100)
    assert 100 - GROWTH - 4 <= len(out) <= 100


def test_the_budget_leaves_room_for_the_shortest_call(structured):
    backend = structured.backend
    p = _call(CITY, analysis_budget=1000)
    answer = backend.answer_tokens(p)
    # `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city":""}<|call|>`
    assert answer is not None and 30 < answer < 50
    overhead = backend.analysis_overhead()
    assert overhead == len("analysis") + len("assistant") + 4
    assert structured.budget(p, 500) == 500 - answer - overhead
    assert structured.budget(p, answer + overhead + 3) == 3
    assert structured.budget(p, answer) == 0            # no room: no analysis message
    assert structured.budget(_call(CITY, analysis_budget=5), 500) == 5


def test_n_children_take_their_endings_independently(structured):
    m = _matcher(structured, _call(CITY, analysis_budget=0), 100)
    child = m.fork()
    a = generate(m, stubborn(m.backend), 100)
    b = generate(child, lambda allowed: allowed[-1], 100)
    assert m.terminated and child.terminated and a != b


def test_no_ending_without_harmony_or_max_tokens(structured):
    """Other constraints pay nothing per token: no Ending to check."""
    for p, max_tokens in [(StructuredOutputsParams(json=CITY), 50), (_call(CITY), None)]:
        m = structured.matcher(SamplingParams(max_tokens=max_tokens, structured_outputs=p))
        assert m is not None and m.ending is None


def test_requested_budgets():
    """reasoning effort → budget (KVRELAY_STRUCTURED_ANALYSIS_BUDGET is medium), at most half
    of max_tokens; an explicit thinking_token_budget is taken as given, -1 is all there is."""
    assert [effort_budget(e) for e in ("low", "medium", "high", None)] == [256, 1024, 4096, 1024]
    assert requested_budget("high", None, None) == 4096
    assert requested_budget("high", None, 1000) == 500
    assert requested_budget("low", None, 10_000) == 256
    assert requested_budget("low", 700, 1000) == 700
    assert requested_budget(None, 0, 1000) == 0
    assert requested_budget(None, -1, 1000) == 1000


def test_the_server_puts_the_requested_budget_on_harmony_constraints():
    """structured_hooks.with_budget: effort and thinking_token_budget from the chat body,
    half of max_tokens at most for an effort; other constraints are left as they are."""
    from types import SimpleNamespace

    from kvrelay.server.structured_hooks import with_budget

    def budget(p: StructuredOutputsParams, max_tokens: int, **body: object) -> int | None:
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=p)
        out = with_budget(params, SimpleNamespace(**body)).structured_outputs
        assert out is not None
        return out.analysis_budget
    assert budget(_call(CITY), 100_000, reasoning_effort="high") == 4096
    assert budget(_call(CITY), 1000, reasoning_effort="high") == 500
    assert budget(_call(CITY), 1000, reasoning_effort="low", thinking_token_budget=900) == 900
    assert budget(_call(CITY), 1000, thinking_token_budget=-1) == 1000
    assert budget(StructuredOutputsParams(json=CITY), 1000, reasoning_effort="high") is None
