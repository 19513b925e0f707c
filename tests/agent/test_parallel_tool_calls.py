"""`parallel_tool_calls` on every path (issue 29, item 2): false → at most one call in the
answer, true (the default) → several where the format can hold them.

Harmony: a call ending in `<|call|>` ends the turn anyway; one ending in `<|end|>` can be
followed by another. Under false the turn is cut after the first call and the engine
request closed (chat stream / not, Responses stream / not). Template models: their calls
are one JSON list, which the grammar holds to one item (`maxItems: 1`) and the parser to
its first call when no grammar enforced it."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from kvrelay.engine.outputs import RequestOutput
from kvrelay.harmony import END_ID, get_encoding
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.tools import AgentOptions, tool_spec
from kvrelay.structured.grammar import build_grammar
from kvrelay.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallConstraint
from tests.agent.fakes import (
    EOS,
    MODEL,
    ScriptedEngine,
    char_tokenizer,
    make_state,
    openai_client,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
RTOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
USER = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
# two calls in one turn: the first closed with <|end|>, the second with <|call|>
TWO_CALLS = (CALL + '{"city":"Oslo"}<|end|><|start|>assistant' + CALL + '{"city":"Rome"}<|call|>'
             + "<|start|>assistant<|channel|>final<|message|>never reached<|return|>")
OSLO, ROME = ("get_weather", '{"city":"Oslo"}'), ("get_weather", '{"city":"Rome"}')


def _ids(text: str) -> list[int]:
    return get_encoding().encode(text, allowed_special="all")


def _decode(ids: list[int]) -> str:
    return get_encoding().decode([i for i in ids if i < 199998])


@dataclass
class CountingEngine(ScriptedEngine):
    """ScriptedEngine that counts the tokens it produced for the last request."""
    produced: list[int] = field(default_factory=list)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.produced.append(0)
        async for out in super().generate(request_id, prompt, params, kv_transfer_params):
            self.produced[-1] += 1
            yield out


def _harmony(script: str):
    engine = CountingEngine(lambda prompt: _ids(script), _decode)
    client, _ = openai_client(make_state(engine, True, AgentOptions()))   # no tool flags
    return engine, client


def _chat_calls(client, stream: bool, **kw) -> tuple[list[tuple[str, str]], str, int | None]:
    """The calls, finish reason and completion tokens of one chat request."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, **kw)
        calls = [(c.function.name, c.function.arguments)
                 for c in out.choices[0].message.tool_calls or []]
        return calls, out.choices[0].finish_reason, out.usage.completion_tokens
    merged: dict[int, list[str]] = {}
    finish, usage = None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                slot = merged.setdefault(tc.index, ["", ""])
                slot[0] += tc.function.name or ""
                slot[1] += tc.function.arguments or ""
    return [(n, a) for _, (n, a) in sorted(merged.items())], finish, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel, calls", [(False, [OSLO]), (True, [OSLO, ROME]),
                                             (None, [OSLO, ROME])])
def test_harmony_chat(stream, parallel, calls):
    engine, client = _harmony(TWO_CALLS)
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    got, finish, tokens = _chat_calls(client, stream, **kw)
    assert (got, finish) == (calls, "tool_calls")
    first_call_end = _ids(TWO_CALLS).index(END_ID) + 1
    if parallel is False:
        # the turn ended at the first call's <|end|>: the engine was closed there
        assert tokens == first_call_end == engine.produced[-1]
    else:
        assert tokens == engine.produced[-1] == _ids(TWO_CALLS).index(_ids("<|call|>")[0]) + 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel, calls", [(False, [OSLO]), (True, [OSLO, ROME])])
def test_harmony_responses(stream, parallel, calls):
    engine, client = _harmony(TWO_CALLS)
    kw = {"model": MODEL, "input": "Weather?", "tools": RTOOLS, "parallel_tool_calls": parallel}
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        assert events[-1].type == "response.completed"
        out = events[-1].response
    else:
        out = client.responses.create(**kw)
    assert out.status == "completed" and out.parallel_tool_calls is parallel
    assert [(i.name, i.arguments) for i in out.output if i.type == "function_call"] == calls
    if parallel is False:
        assert out.usage.output_tokens == engine.produced[-1] == _ids(TWO_CALLS).index(END_ID) + 1


def test_harmony_call_ended_by_call_token_is_untouched():
    """The usual turn (one call, `<|call|>`) is the same either way."""
    script = CALL + '{"city":"Oslo"}<|call|>'
    for parallel in (False, True):
        _, client = _harmony(script)
        assert _chat_calls(client, False, parallel_tool_calls=parallel)[:2] == (
            [OSLO], "tool_calls")


def test_one_call_per_turn_with_n_outputs():
    """n = 2: each output is cut after its first call; the request ends (and the engine's
    generator is closed) once both have ended, before the engine would have finished."""
    import asyncio

    from kvrelay.engine.outputs import CompletionOutput
    from kvrelay.server.harmony_chat import one_call_per_turn
    scripts = [_ids(TWO_CALLS), _ids(CALL + '{"city":"Paris"}<|end|><|start|>assistant' + CALL
                                     + '{"city":"Lyon"}<|call|>')]
    closed = []

    async def engine():
        try:
            for step in range(max(map(len, scripts))):
                outs = []
                for i, script in enumerate(scripts):
                    done = step >= len(script) - 1
                    ids = script[:step + 1]
                    outs.append(CompletionOutput(i, "", ids, "stop" if done else None,
                                                 delta_token_ids=script[step:step + 1]))
                yield RequestOutput("r", None, [1], outs, finished=False)
        finally:
            closed.append(True)

    async def run():
        return [out async for out in one_call_per_turn(engine())]

    outs = asyncio.run(run())
    final = outs[-1]
    assert final.finished and closed == [True]
    ends = [s.index(END_ID) + 1 for s in scripts]
    assert [len(o.token_ids) for o in final.outputs] == ends
    assert [o.finish_reason for o in final.outputs] == ["stop", "stop"]
    assert [o.token_ids[-1] for o in final.outputs] == [END_ID, END_ID]
    assert len(outs) == max(ends)          # no step after the last output's call ended
    # once cut, an output shows no new tokens
    first_end = min(ends)
    assert all(o.outputs[ends.index(first_end)].delta_token_ids == []
               for o in outs[first_end:])


# ------------------------------------------------------------------ template models


def _template(text: str):
    tok = char_tokenizer()
    engine = ScriptedEngine(lambda prompt: [*tok.encode(text), EOS], tok.decode)
    client, _ = openai_client(make_state(engine, False, AgentOptions(), tokenizer=tok))
    return engine, client


TWO_JSON_CALLS = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                             {"name": "get_weather", "parameters": {"city": "Rome"}}])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel, count", [(False, 1), (True, 2)])
def test_template_model_forced_calls(stream, parallel, count):
    engine, client = _template(TWO_JSON_CALLS)
    got, finish, _ = _chat_calls(client, stream, tool_choice="required",
                                 parallel_tool_calls=parallel)
    assert finish == "tool_calls" and len(got) == count
    assert [json.loads(a) for _, a in got] == [{"city": "Oslo"}, {"city": "Rome"}][:count]
    constraint = engine.requests[-1][1].structured_outputs.tool_call
    assert constraint.parallel is parallel
    out = client.responses.create(model=MODEL, input="x", tools=RTOOLS, tool_choice="required",
                                  parallel_tool_calls=parallel)
    assert len([i for i in out.output if i.type == "function_call"]) == count


def test_grammar_holds_the_json_list_to_one_call():
    fns = (FunctionSpec("get_weather", WEATHER),)
    for parallel, max_items in ((False, 1), (True, None)):
        p = StructuredOutputsParams(tool_call=ToolCallConstraint(fns, parallel=parallel))
        schema = json.loads(build_grammar(p))["grammars"][0]["json_schema"]
        assert schema.get("maxItems") == max_items and schema["minItems"] == 1
        assert StructuredOutputsParams.from_dict(p.to_dict()) == p


def test_parallel_tool_calls_must_be_a_boolean():
    from kvrelay.server.protocol import OpenAIError
    assert tool_spec(TOOLS, "auto").parallel and not tool_spec(TOOLS, "auto", False).parallel
    with pytest.raises(OpenAIError, match="parallel_tool_calls"):
        tool_spec(TOOLS, "auto", "no")
