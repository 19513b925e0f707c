"""Agents against a live `kvrelay serve` (tiny o200k gpt-oss checkpoint, scripted engine):
the openai client's chat.completions with tools, responses.create / responses.stream with
previous_response_id, GET / DELETE, and OpenAI Agents SDK agents through both model classes."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.agent.conftest import ANSWER, CALL_ARGS, MODEL, REASONING, WEATHER_SCHEMA

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER_SCHEMA}}]
RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now",
                   "parameters": WEATHER_SCHEMA, "strict": True}]


@pytest.fixture(scope="module")
def client(agent_server):
    return openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key="x", max_retries=0)


def test_chat_tool_call(client):
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        Role,
        SystemContent,
        ToolDescription,
    )

    from kvrelay.harmony import get_encoding
    out = client.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"}])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and call.function.arguments == CALL_ARGS
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning"] == REASONING
    # the prompt is openai-harmony's rendering of the tools
    dev = DeveloperContent.new().with_function_tools(
        [ToolDescription.new("get_weather", "Weather now", WEATHER_SCHEMA)])
    conv = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
        Message.from_role_and_content(Role.DEVELOPER, dev),
        Message.from_role_and_content(Role.USER, "Weather in Paris?")])
    want = get_encoding().render_conversation_for_completion(conv, Role.ASSISTANT)
    assert out.usage.prompt_tokens == len(want)

    # the tool's result goes back; the model answers
    follow = client.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.content == ANSWER
    assert follow.choices[0].finish_reason == "stop" and not follow.choices[0].message.tool_calls


def test_chat_tool_call_streamed(client):
    stream = client.chat.completions.create(model=MODEL, tools=TOOLS, stream=True, messages=[
        {"role": "user", "content": "Weather in Paris?"}])
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
            slot["id"] = slot["id"] or tc.id
            slot["name"] = slot["name"] or (tc.function.name if tc.function else None)
            slot["args"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"id": calls[0]["id"], "name": "get_weather",
                                     "args": CALL_ARGS}]
    assert calls[0]["id"].startswith("call_")


def test_responses_create_previous_response_get_delete(client):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSE_TOOLS,
                                    reasoning={"effort": "low"}, instructions="Use tools.")
    assert first.status == "completed" and first.id.startswith("resp_")
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and call.arguments == CALL_ARGS
    assert call.call_id.startswith("call_")
    assert first.output[0].content[0].text == REASONING
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    assert first.usage.output_tokens > first.usage.output_tokens_details.reasoning_tokens

    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=RESPONSE_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # the second prompt held the first turn: longer than the first prompt plus its output
    assert second.usage.input_tokens > first.usage.input_tokens + len(CALL_ARGS) // 4

    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == ANSWER
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=second.id)
    assert e.value.body["param"] == "previous_response_id"


def test_responses_stream(client):
    with client.responses.stream(model=MODEL, input="Weather in Paris?",
                                 tools=RESPONSE_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in kinds, kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == CALL_ARGS
    assert [i.type for i in final.output] == ["reasoning", "function_call"]

    # a streamed response is stored too, and continues
    follow = client.responses.create(model=MODEL, previous_response_id=final.id, input=[
        {"type": "function_call_output", "call_id": final.output[1].call_id, "output": "sunny"}])
    assert follow.output_text == ANSWER


def test_responses_text_answer_stream(client):
    with client.responses.stream(model=MODEL, input="Hello") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == ANSWER == final.output_text
    assert [i.type for i in final.output] == ["reasoning", "message"]


def _run_agent(agent_server, model_class: str, streamed: bool = False) -> tuple[str, list[dict]]:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    seen: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather now in a city."""
        seen.append({"city": city})
        return f"sunny in {city}"

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=f"{agent_server.url}/v1", api_key="x",
                                    max_retries=0)
        cls = OpenAIResponsesModel if model_class == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="weather", instructions="Use the weather tool.", tools=[get_weather],
                      model=cls(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0.0))
        try:
            if streamed:
                result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
        finally:
            await client.close()
        return result.final_output

    return asyncio.run(run()), seen


@pytest.mark.parametrize("model_class, streamed", [
    ("responses", False), ("chat_completions", False), ("responses", True),
    ("chat_completions", True)])
def test_agents_sdk_loop(agent_server, model_class, streamed):
    final, seen = _run_agent(agent_server, model_class, streamed)
    assert seen == [{"city": "Paris"}]      # the tool ran once, with schema-valid arguments
    assert final == ANSWER


def test_bad_tool_inputs_are_400(agent_server):
    url = f"{agent_server.url}/v1"
    cases = [
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0]"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ("responses", {"input": [{"type": "computer_call", "id": "c"}]}, "input[0]"),
        ("responses", {"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ]
    for path, body, param in cases:
        r = httpx.post(f"{url}/{path}", json={"model": MODEL, **body})
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
