"""tool_choice required / named on a random-weight model: only the grammar makes it call a
tool with schema-valid arguments. NEEDS the structured-outputs engine (agentapi's
kvrelay/structured/ mask, applied in the sampler): skipped where this build has only the
StructuredOutputsParams contract. The Agents SDK on the same kind of model:
test_agents_sdk.py."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kvrelay.server import structured_hooks
from tests.agent.conftest import AGENT_FLAGS, MODEL
from tests.processes import Server

pytestmark = pytest.mark.skipif(not structured_hooks.available(),
                                reason="needs the structured-outputs engine (kvrelay/structured/)")

# bounded, so every valid call is short: a weak model cannot pad forever
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def random_server(o200k_checkpoint, tmp_path_factory):
    s = Server(str(o200k_checkpoint), ["--dtype", "float32", "--max-model-len", "1024",
                                       "--served-model-name", MODEL, *AGENT_FLAGS],
               tmp_path_factory.mktemp("agent-random") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("seed", range(4))
def test_required_choice_gives_a_schema_valid_call(random_server, seed):
    client = openai.OpenAI(base_url=f"{random_server.url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="required",
                                         seed=seed, max_tokens=160, temperature=1.0,
                                         messages=[{"role": "user", "content": "Weather?"}])
    calls = out.choices[0].message.tool_calls
    assert calls and out.choices[0].finish_reason == "tool_calls"
    for call in calls:
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        else:
            assert call.function.name == "get_time"
            assert json.loads(call.function.arguments) == {}


def test_named_choice_calls_that_function(random_server):
    client = openai.OpenAI(base_url=f"{random_server.url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=160, seed=7,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather?"}])
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_responses_required_choice_and_text_format(random_server):
    client = openai.OpenAI(base_url=f"{random_server.url}/v1", api_key="x", max_retries=0)
    rtools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    out = client.responses.create(model=MODEL, input="Weather?", tools=rtools,
                                  tool_choice="required", max_output_tokens=160)
    calls = [i for i in out.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    for seed in range(2):
        out = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=160,
                                      temperature=1.0, extra_body={"seed": seed},
                                      text={"format": {"type": "json_schema", "name": "W",
                                                       "schema": SCHEMA, "strict": True}})
        assert out.status == "completed"
        jsonschema.validate(json.loads(out.output_text), SCHEMA)
