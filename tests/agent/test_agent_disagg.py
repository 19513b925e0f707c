"""Function calling through `kvrelay proxy` in 1P1D (prefill + decode with vLLM's tool flags,
the scripted engine of tests/agent/scripted.py on the tiny o200k checkpoint): the openai
client's tool calls, streamed and not, the tool-result turn, and an Agents SDK agent through
the Chat Completions model class."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.agent.conftest import (
    AGENT_FLAGS,
    ANSWER,
    CALL_ARGS,
    MODEL,
    WEATHER_SCHEMA,
    agent_scripts,
)
from tests.e2e.disagg import start
from tests.processes import KvrelayProcess, free_port

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]


@pytest.fixture(scope="module")
def proxy_url(o200k_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("agent-1p1d")
    flags = ["--max-model-len", "1024", "--served-model-name", MODEL, *AGENT_FLAGS,
             "--logits-processors", "tests.agent.scripted:agent_script"]
    env = {"KVRELAY_AGENT_SCRIPTS": json.dumps(agent_scripts())}
    prefill = start(str(o200k_checkpoint), "kv_producer", logs / "prefill.log", flags=flags,
                    env=env)
    decode = start(str(o200k_checkpoint), "kv_consumer", logs / "decode.log", flags=flags,
                   env=env)
    port = free_port()
    proxy = KvrelayProcess(["proxy", "--port", str(port), "--prefiller-host", "127.0.0.1",
                            "--prefiller-port", str(prefill.port), "--decoder-host", "127.0.0.1",
                            "--decoder-port", str(decode.port)], logs / "proxy.log")
    try:
        for s in (prefill, decode):
            s.wait_ready()
        proxy.wait_for_line("Application startup complete")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proxy.stop()
        for s in (prefill, decode):
            s.stop()


def test_tool_call_through_the_proxy(proxy_url):
    client = openai.OpenAI(base_url=proxy_url, api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", CALL_ARGS)
    assert out.choices[0].finish_reason == "tool_calls"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 stream=True))
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in c.choices[0].delta.tool_calls or [])
    assert args == CALL_ARGS and chunks[-1].choices[0].finish_reason == "tool_calls"

    follow = client.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        *messages, out.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.content == ANSWER


def test_agents_sdk_through_the_proxy(proxy_url):
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather now in a city."""
        seen.append(city)
        return "sunny"

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=proxy_url, api_key="x", max_retries=0)
        try:
            agent = Agent(name="w", tools=[get_weather],
                          model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
            return (await Runner.run(agent, "Weather in Paris?", max_turns=4)).final_output
        finally:
            await client.close()

    assert asyncio.run(run()) == ANSWER and seen == ["Paris"]
