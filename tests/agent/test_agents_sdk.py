"""The OpenAI Agents SDK runs to completion on a random-weight gpt-oss (o200k, harmony) at
temperature 1, through both of its model classes, on a plain `kvrelay serve`: a forced call
of a tool whose argument is a free string, and a structured answer (`output_type`, a pydantic
model). Neither would finish without enforcement that always finishes: a random model
rarely ends its analysis and almost never closes a JSON string (docs/agents.md,
"Enforcement"). Also: `thinking_token_budget`, vLLM's field, bounds the analysis and is
validated."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from pydantic import BaseModel

from kvrelay.server import structured_hooks
from tests.agent.conftest import MODEL
from tests.processes import Server

pytestmark = pytest.mark.skipif(not structured_hooks.available(),
                                reason="needs the structured-outputs engine (kvrelay/structured/)")

SEEDS = range(3)
MAX_TOKENS = 128            # as the Agents SDK user of the issue set it
FREE_CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
             "additionalProperties": False}


class Forecast(BaseModel):
    city: str
    days: int
    sunny: bool


@pytest.fixture(scope="module")
def server(o200k_checkpoint, tmp_path_factory):
    """The README's plain `kvrelay serve` (no tool flags) on the random o200k checkpoint."""
    s = Server(str(o200k_checkpoint), ["--dtype", "float32", "--max-model-len", "1024",
                                       "--served-model-name", MODEL],
               tmp_path_factory.mktemp("agents-sdk") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _run_agent(url: str, model_class: str, task: str, seed: int) -> tuple[object, list[str]]:
    """One Agents SDK run; returns (final output, the cities the tool was called with)."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel
    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city (a free string: nothing bounds the model's argument)."""
        seen.append(city)
        return f"forecast for {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        cls = OpenAIResponsesModel if model_class == "responses" else OpenAIChatCompletionsModel
        settings = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "extra_body": {"seed": seed}}
        if task == "tool":
            agent = Agent(name="w", tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                          model=cls(model=MODEL, openai_client=client),
                          model_settings=ModelSettings(tool_choice="required", **settings))
        else:
            agent = Agent(name="w", output_type=Forecast, model_settings=ModelSettings(**settings),
                          model=cls(model=MODEL, openai_client=client))
        try:
            return (await Runner.run(agent, "Weather in Paris?", max_turns=2)).final_output
        finally:
            await client.close()

    return asyncio.run(run()), seen


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("task", ["tool", "output_type"])
@pytest.mark.parametrize("model_class", ["responses", "chat_completions"])
def test_agent_runs_to_completion(server, model_class, task, seed):
    final, seen = _run_agent(server.url, model_class, task, seed)
    if task == "tool":
        assert len(seen) == 1 and final == f"forecast for {seen[0]}"
    else:
        assert isinstance(final, Forecast) and not seen


def test_thinking_token_budget_bounds_the_analysis(server):
    """Responses: `usage.output_tokens_details.reasoning_tokens` ≤ the budget; chat with 0:
    no analysis message at all."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": FREE_CITY}]
    for seed in SEEDS:
        out = client.responses.create(model=MODEL, input="Weather?", tools=tools,
                                      tool_choice="required", max_output_tokens=MAX_TOKENS,
                                      temperature=1.0,
                                      extra_body={"seed": seed, "thinking_token_budget": 5})
        assert out.status == "completed"
        assert out.usage.output_tokens_details.reasoning_tokens <= 5
        assert [i.type for i in out.output][-1] == "function_call"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=MAX_TOKENS,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": FREE_CITY}}],
        tool_choice="required", temperature=1.0, seed=1, extra_body={"thinking_token_budget": 0})
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls" and message.tool_calls
    assert getattr(message, "reasoning", None) is None


@pytest.mark.parametrize("bad", [-2, 1.5, True, "8"])
def test_a_bad_thinking_token_budget_is_a_400(server, bad):
    bodies = {"chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
              "responses": {"input": "hi"}}
    for path, body in bodies.items():
        r = httpx.post(f"{server.url}/v1/{path}", timeout=30,
                       json={"model": MODEL, "thinking_token_budget": bad, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "thinking_token_budget" and error["type"] == "BadRequestError"
