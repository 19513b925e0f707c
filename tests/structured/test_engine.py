"""Structured outputs in the engine (offline LLM API) on random-weight tiny checkpoints:
every constrained output validates, at temperature 1, over many seeds."""
from __future__ import annotations

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.structured.params import FunctionSpec, ToolCallConstraint
from kvrelay.structured.params import StructuredOutputsParams as Constraint
from tests.structured.schemas import CHOICES, PERSON, REGEX, WEATHER, valid_json, valid_regex

SEEDS = range(12)


@pytest.fixture(scope="module")
def llm(bytes_ckpt):
    engine = LLM(str(bytes_ckpt), dtype="float32", max_model_len=256, block_size=4)
    yield engine
    assert not engine.engine.has_unfinished_requests()
    engine.engine.assert_no_leaks()


def _sample(constraint: Constraint, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 120),
                          structured_outputs=constraint, **kw)


def test_json_regex_choice_valid_over_seeds(llm):
    cases = [(Constraint(json=PERSON), lambda t: valid_json(t, PERSON)),
             (Constraint(regex=REGEX), valid_regex),
             (Constraint(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t))]
    params = [_sample(c, s) for c, _ in cases for s in SEEDS]
    outs = llm.generate(["Tell me"] * len(params), params)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        cases[i // len(SEEDS)][1](c.text)


def test_json_object_grammar_and_tool_calls(llm):
    tools = ToolCallConstraint((FunctionSpec("weather", WEATHER), FunctionSpec("person", PERSON)))
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    outs = llm.generate(["Tell me"] * 3, [
        _sample(Constraint(json_object=True, any_whitespace=False), 1, max_tokens=200),
        _sample(Constraint(grammar=ebnf), 2),
        _sample(Constraint(tool_call=tools), 3, max_tokens=200)])
    import json
    import re
    obj, gram, calls = (o.outputs[0] for o in outs)
    if obj.finish_reason == "stop":              # an unbounded object may run out of tokens
        assert isinstance(json.loads(obj.text), dict)
    assert obj.text.startswith("{")
    assert re.fullmatch(r"yes|no|maybe [0-9]", gram.text), gram.text
    if calls.finish_reason == "stop":
        for call in json.loads(calls.text):
            valid_json(json.dumps(call["parameters"], separators=(",", ":"), ensure_ascii=False),
                       {"weather": WEATHER, "person": PERSON}[call["name"]])


def test_n_children_each_follow_the_grammar(llm):
    out = llm.generate("Tell me", _sample(Constraint(json=WEATHER), 7, n=4))[0]
    texts = [c.text for c in out.outputs]
    for t in texts:
        valid_json(t, WEATHER)
    assert len(set(texts)) > 1                  # independent matchers, independent samples


def test_requests_without_grammar_are_unchanged(llm):
    """Greedy tokens of an unconstrained request are the same alone and in a batch with
    constrained requests (their masks touch only their own rows)."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Tell me", plain)[0].outputs[0].token_ids
    mixed = llm.generate(["Tell me", "Tell me", "Other"],
                         [plain, _sample(Constraint(json=PERSON), 1),
                          _sample(Constraint(regex=REGEX), 2)])
    assert mixed[0].outputs[0].token_ids == alone
    assert len(alone) == 12


def test_bad_constraints_are_value_errors(llm):
    for bad, words in [(Constraint(regex="a("), "unclosed group"),
                       (Constraint(json={"type": "objekt"}), "objekt"),
                       (Constraint(grammar="root ::= missing"), "missing")]:
        with pytest.raises(ValueError, match=words):
            llm.generate("x", _sample(bad, 0))


def test_preempted_requests_keep_their_grammar(bytes_ckpt):
    """Few KV blocks: requests are preempted and recomputed; their matchers stay with the
    kept output tokens, and every output still validates."""
    llm = LLM(str(bytes_ckpt), dtype="float32", max_model_len=96, block_size=4,
              num_gpu_blocks_override=30)
    params = [_sample(Constraint(json=PERSON), s, max_tokens=60) for s in range(6)]
    outs = llm.generate(["Tell me about a person"] * 6, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            valid_json(out.outputs[0].text, PERSON)
    llm.engine.assert_no_leaks()


def test_harmony_turn_constrained_from_the_first_token(harmony_ckpt):
    """o200k + harmony: an optional free analysis message within the budget, then the
    final answer (valid JSON) or a call of one of the tools (valid arguments)."""
    from kvrelay import harmony
    llm = LLM(str(harmony_ckpt), dtype="float32", max_model_len=512, block_size=16)
    prompt = harmony.render_chat([{"role": "user", "content": "Weather in Paris?"}], None)
    tools = ToolCallConstraint((FunctionSpec("get_weather", WEATHER),
                                FunctionSpec("person", PERSON)))
    budget = 12

    def params(c: Constraint, seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=100, skip_special_tokens=False,
                              stop_token_ids=harmony.stop_token_ids(), structured_outputs=c)
    seeds = range(6)
    answers = [params(Constraint(json=WEATHER, harmony=True, analysis_budget=budget), s)
               for s in seeds]
    calls = [params(Constraint(tool_call=tools, harmony=True, analysis_budget=budget), s)
             for s in seeds]
    outs = llm.generate([prompt] * (len(answers) + len(calls)), answers + calls)
    analysed = 0
    for i, out in enumerate(outs):
        c = out.outputs[0]
        parsed = harmony.parse_completion(c.token_ids)
        assert c.finish_reason == "stop" and not parsed.malformed, c.text
        analysed += bool(parsed.reasoning)
        if parsed.reasoning:                     # the analysis ends within its budget
            start = c.token_ids.index(harmony.MESSAGE_ID) + 1
            assert c.token_ids.index(harmony.END_ID) - start <= budget
        if i < len(answers):
            assert c.stop_reason == harmony.RETURN_ID
            valid_json(parsed.content, WEATHER)
        else:
            assert c.stop_reason == harmony.CALL_ID and len(parsed.tool_calls) == 1
            call = parsed.tool_calls[0]
            valid_json(call.arguments, {"get_weather": WEATHER, "person": PERSON}[call.name])
    assert analysed > 0
    llm.engine.assert_no_leaks()


def test_async_scheduling_gives_the_same_constrained_outputs(llm, bytes_ckpt):
    """Planned a step ahead, each step's masks are still filled from matchers that have
    seen the previous step's token: 18 constrained rows (enough for the masks to fill
    on their thread during the forward) give the synchronous run's outputs exactly."""
    cases = [Constraint(json=PERSON), Constraint(regex=REGEX), Constraint(choice=CHOICES)]
    params = [_sample(cases[s % 3], s, max_tokens=60) for s in range(18)]
    want = [o.outputs[0] for o in llm.generate(["Tell me"] * 18, params)]
    fast = LLM(str(bytes_ckpt), dtype="float32", max_model_len=256, block_size=4,
               async_scheduling=True)
    got = [o.outputs[0] for o in fast.generate(["Tell me"] * 18, params)]
    assert [(c.token_ids, c.finish_reason) for c in got] == \
        [(c.token_ids, c.finish_reason) for c in want]
    assert sum(c.finish_reason == "stop" for c in got) >= 15
    fast.engine.assert_no_leaks()
    fast.shutdown()
