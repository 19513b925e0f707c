"""Tool calling and the Responses API over an in-process app with a scripted fake engine
(tests/agent/fakes.py): the constraints handed to the engine for tool_choice and
text.format, vLLM's flag rule for tool_choice "auto", template (non-harmony) models, the
responses store, and 400s with OpenAI error bodies for bad input."""
from __future__ import annotations

import json

import openai
import pytest

from kvrelay.harmony import get_encoding
from kvrelay.server.tools import AgentOptions
from kvrelay.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallConstraint
from tests.agent.fakes import (
    EOS,
    MODEL,
    PLAIN_TEMPLATE,
    TOOL_TEMPLATE,
    ScriptedEngine,
    char_tokenizer,
    make_state,
    openai_client,
)
from tests.harmony_factories import scripted_harmony_answer, scripted_tool_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
RTOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
          {"type": "function", "name": "get_time", "parameters": TIME}]
USER = [{"role": "user", "content": "Weather?"}]
AUTO = AgentOptions(enable_auto_tool_choice=True, tool_call_parser="openai")


def _decode(ids: list[int]) -> str:
    return get_encoding().decode([i for i in ids if i < 199998])


def _harmony(script: list[int], agent: AgentOptions = AUTO, **kw):
    engine = ScriptedEngine(lambda prompt: script, _decode)
    client, http = openai_client(make_state(engine, True, agent, **kw))
    return engine, client, http


def _error(http, path: str, body: dict) -> dict:
    r = http.post(f"/v1/{path}", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    return err


# ------------------------------------------------------------------ tool_choice → constraint


def test_required_and_named_choice_constrain_the_harmony_turn():
    engine, client, _ = _harmony(scripted_tool_call("get_weather", '{"city":"Oslo"}'),
                                 agent=AgentOptions())     # no flags needed for these
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                         tool_choice="required")
    assert out.choices[0].finish_reason == "tool_calls"
    assert engine.requests[-1][1].structured_outputs == StructuredOutputsParams(
        tool_call=ToolCallConstraint((FunctionSpec("get_weather", WEATHER),
                                      FunctionSpec("get_time", TIME))), harmony=True,
        analysis_budget=1024)          # medium effort's (kvrelay/structured/manager.py)
    client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    assert engine.requests[-1][1].structured_outputs.tool_call.functions == (
        FunctionSpec("get_time", TIME),)
    # auto / none: no constraint
    engine, client, _ = _harmony(scripted_harmony_answer("", "Hi"))
    for choice in ("auto", "none"):
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice=choice)
        assert engine.requests[-1][1].structured_outputs is None


def test_responses_constraints():
    engine, client, _ = _harmony(scripted_tool_call("get_weather", '{"city":"Oslo"}'))
    client.responses.create(model=MODEL, input="x", tools=RTOOLS,
                            tool_choice={"type": "function", "name": "get_weather"})
    assert engine.requests[-1][1].structured_outputs == StructuredOutputsParams(
        tool_call=ToolCallConstraint((FunctionSpec("get_weather", WEATHER),)), harmony=True,
        analysis_budget=1024)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(model=MODEL, input="x", text={"format": {
        "type": "json_schema", "name": "A", "schema": schema}})
    assert engine.requests[-1][1].structured_outputs == StructuredOutputsParams(
        json=schema, harmony=True, analysis_budget=1024)
    # a format with tools the model may call: "a call or the formatted answer"
    client.responses.create(model=MODEL, input="x", tools=RTOOLS[:1], text={"format": {
        "type": "json_schema", "name": "A", "schema": schema}})
    assert engine.requests[-1][1].structured_outputs == StructuredOutputsParams(
        json=schema, harmony=True, tool_call=ToolCallConstraint(
            (FunctionSpec("get_weather", WEATHER),), required=False), analysis_budget=1024)
    client.responses.create(model=MODEL, input="x")
    assert engine.requests[-1][1].structured_outputs is None


def test_auto_tool_choice_needs_vllms_flags_on_template_models_only():
    """A harmony model's chat format carries its calls: "auto" works on a plain `kvrelay
    serve` (issue 29: the Agents SDK's second turn got this 400); a template model keeps
    vLLM's rule."""
    _, client, http = _harmony(scripted_tool_call("get_weather", '{"city":"Oslo"}'),
                               agent=AgentOptions())
    for choice in ("auto", None):
        out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                             **({"tool_choice": choice} if choice else {}))
        assert out.choices[0].finish_reason == "tool_calls"
        assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    # plain chat and the Responses API (vLLM's too) need no flag
    assert client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content
    assert client.responses.create(model=MODEL, input="x", tools=RTOOLS).output[0].type == \
        "function_call"
    tok = char_tokenizer()
    engine = ScriptedEngine(lambda prompt: [*tok.encode("Fine."), EOS], tok.decode)
    _, http = openai_client(make_state(engine, False, AgentOptions(), tokenizer=tok))
    err = _error(http, "chat/completions", {"messages": USER, "tools": TOOLS})
    assert "--enable-auto-tool-choice" in err["message"] and err["param"] == "tool_choice"


@pytest.mark.parametrize("kwargs, match", [
    ({"tool_call_parser": "hermes"}, "--tool-call-parser: only openai"),
    ({"reasoning_parser": "deepseek_r1"}, "--reasoning-parser: only openai_gptoss"),
    ({"enable_auto_tool_choice": True}, "requires --tool-call-parser"),
])
def test_agent_options_refuse_other_parsers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AgentOptions(**kwargs)


def test_serve_refuses_other_parser_in_one_line(capsys):
    from kvrelay.cli import main
    assert main(["serve", "--tool-call-parser", "hermes"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tool-call-parser" in err and "'hermes'" in err


# ------------------------------------------------------------------ template (non-harmony) models


def _template(text: str, template: str = TOOL_TEMPLATE):
    tok = char_tokenizer(template)
    engine = ScriptedEngine(lambda prompt: [*tok.encode(text), EOS], tok.decode)
    client, http = openai_client(make_state(engine, False, AUTO, tokenizer=tok))
    return engine, client, http, tok


def test_template_model_tools_and_forced_call():
    calls = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    engine, client, _, tok = _template(calls)
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                         tool_choice="required")
    prompt = tok.decode(engine.requests[-1][0])
    assert prompt.endswith("<tools>get_weather,get_time<assistant>")    # the template saw tools
    assert engine.requests[-1][1].structured_outputs.tool_call is not None
    assert engine.requests[-1][1].structured_outputs.harmony is False
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": "Oslo"})
    assert out.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                 tool_choice="required", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("get_weather", '{"city": "Oslo"}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    resp = client.responses.create(model=MODEL, input="x", tools=RTOOLS, tool_choice="required")
    assert [(i.type, i.name) for i in resp.output] == [("function_call", "get_weather")]
    # the call and its result go back through the template
    history = [*USER, out.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="auto",
                                   messages=history)
    prompt = tok.decode(engine.requests[-1][0])
    assert "<assistant>[call get_weather]<tool>sunny" in prompt
    # a template without a tool syntax sees the earlier call as its JSON
    engine, client, _, tok = _template("Fine.", PLAIN_TEMPLATE)
    answer = client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="auto",
                                            messages=history)
    assert answer.choices[0].message.content == "Fine." and not answer.choices[0].message.tool_calls
    prompt = tok.decode(engine.requests[-1][0])
    assert '<assistant>[{"name": "get_weather", "parameters": "{\\"city\\"' in prompt, prompt


@pytest.mark.parametrize("template", [TOOL_TEMPLATE, PLAIN_TEMPLATE])
@pytest.mark.parametrize("calls", [["get_weather"], [{"function": "x"}], [{"function": {}}], "x"])
def test_malformed_earlier_tool_calls_are_400s_on_template_models(template, calls):
    """A template model used to answer tool_calls entries that are not objects with a 500."""
    _, _, http, _ = _template("Fine.", template)
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": calls}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "tool_calls" in error["message"]


# ------------------------------------------------------------------ responses store


def test_store_evicts_least_recently_used_and_can_be_off():
    _, client, http = _harmony(scripted_harmony_answer("", "Hi"),
                               agent=AgentOptions(responses_store_size=2))
    a, b = (client.responses.create(model=MODEL, input="x") for _ in range(2))
    client.responses.retrieve(a.id)                                     # a is now newest
    c = client.responses.create(model=MODEL, input="x")
    assert http.get(f"/v1/responses/{b.id}").status_code == 404         # b was evicted
    assert client.responses.retrieve(a.id).id == a.id and client.responses.retrieve(c.id)
    nostore = client.responses.create(model=MODEL, input="x", store=False)
    assert http.get(f"/v1/responses/{nostore.id}").status_code == 404
    err = http.delete("/v1/responses/resp_nope").json()["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404

    _, client, http = _harmony(scripted_harmony_answer("", "Hi"),
                               agent=AgentOptions(responses_store_size=0))
    off = client.responses.create(model=MODEL, input="x")
    assert off.model_extra.get("store") is False
    assert http.get(f"/v1/responses/{off.id}").status_code == 404
    err = _error(http, "responses", {"input": "x", "previous_response_id": off.id})
    assert "VLLM_ENABLE_RESPONSES_API_STORE" in err["message"]


def test_max_output_tokens_gives_an_incomplete_response():
    _, client, _ = _harmony(scripted_harmony_answer("Thinking hard.", "Hi"))
    out = client.responses.create(model=MODEL, input="x", max_output_tokens=4)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 4


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
    ("chat/completions", {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "nope"}}]}, "tools[0]"),
    ("chat/completions", {"messages": USER, "tools": "f"}, "tools"),
    ("chat/completions", {"messages": USER, "tools": TOOLS + TOOLS[:1]}, "tools"),
    ("chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"},
     "tool_choice"),
    ("chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("responses", {"input": "x", "tools": RTOOLS, "tool_choice": {"type": "function",
                                                                  "name": "nope"}},
     "tool_choice"),
    ("responses", {"input": [{"type": "file_search_call", "id": "f"}]}, "input[0]"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content"),
    ("responses", {"input": "x", "tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ("responses", {"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ("responses", {"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ("responses", {"input": "x", "previous_response_id": "resp_unknown"},
     "previous_response_id"),
    ("responses", {"input": "x", "background": True, "store": False}, "store"),
    ("responses", {"input": "x", "text": {"format": 5}}, "text.format"),
    ("responses", {"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}},
     "text.format"),
    ("responses", {"input": "x", "reasoning": {"effort": 3}}, "reasoning.effort"),
    ("responses", {"input": [5]}, "input[0]"),
    ("responses", {"input": "x", "tools": RTOOLS, "tool_choice": {"type": "function",
                                                                  "name": 5}}, "tool_choice"),
])
def test_bad_input_is_a_400_with_an_openai_error(path, body, param):
    _, _, http = _harmony(scripted_harmony_answer("", "Hi"))
    assert _error(http, path, body)["param"] == param


def test_openai_client_raises_bad_request():
    _, client, _ = _harmony(scripted_harmony_answer("", "Hi"))
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "x"}])


@pytest.mark.parametrize("api, effort, line", [
    ("chat", None, "Reasoning: medium"), ("chat", "high", "Reasoning: high"),
    ("responses", None, "Reasoning: medium"), ("responses", "low", "Reasoning: low"),
])
def test_reasoning_effort_sets_the_harmony_system_message(api, effort, line):
    engine, client, _ = _harmony(scripted_harmony_answer("", "Hi"))
    if api == "chat":
        extra = {"reasoning_effort": effort} if effort else {}
        client.chat.completions.create(model=MODEL, messages=USER, **extra)
    else:
        out = client.responses.create(model=MODEL, input="x",
                                      **({"reasoning": {"effort": effort}} if effort else {}))
        assert out.reasoning.effort == (effort or "medium")
    system = _decode(engine.requests[-1][0]).split("# Valid channels")[0]
    assert line in system and system.count("Reasoning:") == 1


def test_responses_sampling_fields_reach_the_engine():
    engine, client, _ = _harmony(scripted_harmony_answer("", "Hi"))
    client.responses.create(model=MODEL, input="x", temperature=0.5, top_p=0.9,
                            max_output_tokens=7, extra_body={"seed": 3})
    params = engine.requests[-1][1]
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (0.5, 0.9, 7, 3)


def test_attach_combines_with_a_response_format():
    """A response format set by the structured-outputs side (response_format on chat) stays;
    with callable tools it becomes "a call or the formatted answer"; a forced call wins."""
    from kvrelay.sampling_params import SamplingParams
    from kvrelay.server import structured_hooks
    from kvrelay.server.tools import tool_spec
    fmt = StructuredOutputsParams(json={"type": "object"}, harmony=True)
    auto, required = tool_spec(TOOLS, "auto"), tool_spec(TOOLS, "required")
    p = structured_hooks.attach(SamplingParams(structured_outputs=fmt), None, auto)
    assert p.structured_outputs.json == {"type": "object"}
    assert p.structured_outputs.tool_call.required is False
    assert [f.name for f in p.structured_outputs.tool_call.functions] == ["get_weather", "get_time"]
    p = structured_hooks.attach(SamplingParams(structured_outputs=fmt), None,
                                tool_spec(TOOLS, "none"))
    assert p.structured_outputs == fmt
    forced = structured_hooks.tool_call(required, harmony=True)
    p = structured_hooks.attach(SamplingParams(structured_outputs=fmt), forced, required)
    assert p.structured_outputs == forced
    assert structured_hooks.attach(SamplingParams(), None, auto).structured_outputs is None


# -- OpenRouter's `reasoning` object (OpenAI's gpt-oss guide) -----------------------------------
def test_openrouter_reasoning_effort_sets_the_harmony_system_message():
    engine, client, _ = _harmony(scripted_harmony_answer("", "Hi"))
    client.chat.completions.create(model=MODEL, messages=USER,
                                   extra_body={"reasoning": {"effort": "high"}})
    system = _decode(engine.requests[-1][0]).split("# Valid channels")[0]
    assert "Reasoning: high" in system and system.count("Reasoning:") == 1


def test_reasoning_exclude_hides_the_analysis_whole_and_streamed():
    _, client, _ = _harmony(scripted_harmony_answer("Think about weather.", "Sunny."))
    hidden = {"reasoning": {"exclude": True}}
    out = client.chat.completions.create(model=MODEL, messages=USER, extra_body=hidden)
    assert out.choices[0].message.content == "Sunny."
    assert not {"reasoning", "reasoning_content"} & set(out.choices[0].message.model_extra or {})
    shown = client.chat.completions.create(model=MODEL, messages=USER)
    assert shown.choices[0].message.model_extra["reasoning"] == "Think about weather."
    assert out.usage.completion_tokens == shown.usage.completion_tokens   # it still happened
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                 extra_body=hidden))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sunny."
    assert not any({"reasoning", "reasoning_content"} & set(d.model_extra or {}) for d in deltas)


@pytest.mark.parametrize("extra, param", [
    ({"reasoning": {"effort": "high"}, "reasoning_effort": "low"}, "reasoning.effort"),
    ({"reasoning": {"max_tokens": 8}, "thinking_token_budget": 16}, "reasoning.max_tokens"),
    ({"reasoning": {"enabled": False}}, "reasoning.enabled"),
])
def test_reasoning_object_contradictions_are_400s(extra, param):
    _, _, http = _harmony(scripted_harmony_answer("", "Hi"))
    error = _error(http, "chat/completions", {"messages": USER, **extra})
    assert error["param"] == param, error
