"""The engine's side of hostile grammars: the bounds refuse a bomb at `add_request` (the
offline API and every server path get there), and a grammar that fails while its request
runs ends that request alone with an error — never a "stop" with text that breaks the
constraint — and gives its KV blocks back while its batch mates finish normally."""
from __future__ import annotations

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.structured import backend
from kvrelay.structured.params import StructuredOutputsParams as Constraint
from tests.engine.test_isolation import run
from tests.structured import bombs
from tests.structured.schemas import CHOICES, WEATHER, valid_json


@pytest.fixture(scope="module")
def llm(bytes_ckpt):
    engine = LLM(str(bytes_ckpt), dtype="float32", max_model_len=256, block_size=4)
    yield engine
    assert not engine.engine.has_unfinished_requests()
    engine.engine.assert_no_leaks()


def _run(engine, requests: dict[str, SamplingParams]) -> dict:
    """Each request on the prompt "Tell me", run to the end (tests/engine/test_isolation.run)."""
    return run(engine, {rid: ("Tell me", params) for rid, params in requests.items()})


@pytest.mark.parametrize("bomb,limit", [
    (Constraint(choice=bombs.choices(10_000)), "MAX_CHOICES"),
    (Constraint(choice=["x" * 10**6, "y"]), "MAX_CHOICE_CHARS"),
    (Constraint(grammar=bombs.alternatives(20_000)), "MAX_ALTERNATIVES"),
    (Constraint(json=bombs.ref_chain(1200)), "MAX_SCHEMA_DEFINITIONS"),
    (Constraint(json=bombs.ref_chain(300)), "MAX_SCHEMA_EXPANDED_DEPTH"),
    (Constraint(grammar=bombs.lark_chain(3000)), "MAX_GRAMMAR_RULES"),
    (Constraint(grammar=bombs.gbnf_chain(5000)), "MAX_GRAMMAR_RULES"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_engine_refuses_bombs_at_add_and_serves_on(llm, bomb, limit):
    engine = llm.engine
    with pytest.raises(ValueError, match=limit):
        engine.add_request("bomb", "Tell me", SamplingParams(structured_outputs=bomb))
    out = _run(engine, {"honest": SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                                 structured_outputs=Constraint(choice=CHOICES))})
    assert out["honest"].outputs[0].text in CHOICES
    engine.assert_no_leaks()


def test_a_grammar_failing_mid_request_fails_that_request_alone(llm, monkeypatch):
    """The victim's grammar is compiled with llguidance allowing 5 items per Earley row, so
    its matcher fails on its first token (a real llguidance error, as 10,000 choices did
    with the default 2,000); its batch mates compiled with the defaults."""
    import llguidance
    engine = llm.engine
    mates = {"mate-json": SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                         structured_outputs=Constraint(json=WEATHER)),
             "mate-plain": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)}
    alone = _run(engine, {"alone": mates["mate-plain"]})["alone"].outputs[0].token_ids
    for request_id, params in mates.items():
        engine.add_request(request_id, "Tell me", params)
    monkeypatch.setattr(backend, "parser_limits", lambda: llguidance.LLParserLimits(
        max_items_in_row=5, verbose_errors=False))
    victim = Constraint(choice=[f"option number {i}" for i in range(20)])
    engine.add_request("victim", "Tell me", SamplingParams(temperature=1.0, seed=5, n=2,
                                                           max_tokens=30,
                                                           structured_outputs=victim))
    monkeypatch.undo()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    failed = finals["victim"]
    assert failed.error is not None and failed.error_status == 500
    assert failed.error.startswith("structured output failed: Parser Error: Current row has")
    assert "<state>" not in failed.error                  # llguidance's non-verbose message
    assert [o.finish_reason for o in failed.outputs] == ["abort", "abort"]   # both children
    assert all(o.text == "" for o in failed.outputs)
    assert finals["mate-json"].error is None and finals["mate-json"].outputs[0].finish_reason \
        == "stop"
    valid_json(finals["mate-json"].outputs[0].text, WEATHER)
    assert finals["mate-plain"].outputs[0].token_ids == alone    # untouched by the failure
    engine.assert_no_leaks()                                      # the victim's blocks are back
