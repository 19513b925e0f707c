"""Function calling through `kvrelay proxy` in 1P1D (prefill + decode with vLLM's tool flags,
the scripted engine of tests/agent/scripted.py on the tiny o200k checkpoint): the openai
client's tool calls, streamed and not, the tool-result turn, an Agents SDK agent through
the Chat Completions model class, and the Responses API (create, stream, previous_response_id,
GET and DELETE) through the proxy."""
from __future__ import annotations

import asyncio
import json

import httpx
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
def cluster(o200k_checkpoint, tmp_path_factory):
    """(proxy base url, prefill server, decode server)."""
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
        yield f"http://127.0.0.1:{port}/v1", prefill, decode
    finally:
        proxy.stop()
        for s in (prefill, decode):
            s.stop()


@pytest.fixture(scope="module")
def proxy_url(cluster):
    return cluster[0]


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


# ------------------------------------------------------------------ Responses API

PROMPT_TOKENS, KV_PULLS = "vllm:prompt_tokens_total", "kvrelay:kv_transfers_total"


def test_responses_through_the_proxy(cluster):
    url, prefill, decode = cluster
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    before = prefill.metrics()[PROMPT_TOKENS], decode.metrics()[KV_PULLS]
    first = client.responses.create(model=MODEL, input="Hello?")
    assert first.status == "completed" and first.output_text == ANSWER
    # the prefill server computed the prompt, and the decode server pulled its KV
    assert prefill.metrics()[PROMPT_TOKENS] - before[0] == first.usage.input_tokens
    assert decode.metrics()[KV_PULLS] == before[1] + 1

    with client.responses.stream(model=MODEL, input="Hello again?") as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert streamed.output_text == ANSWER and decode.metrics()[KV_PULLS] == before[1] + 2

    # a follow-up goes to the decode server that stored `first` (the prefill has no history)
    prefilled = prefill.metrics()[PROMPT_TOKENS]
    follow = client.responses.create(model=MODEL, input="And now?", previous_response_id=first.id)
    assert follow.previous_response_id == first.id and follow.output_text == ANSWER
    assert follow.usage.input_tokens > first.usage.input_tokens    # the history was in it
    assert prefill.metrics()[PROMPT_TOKENS] == prefilled

    # GET and DELETE reach the decode server that stored them (the streamed one too)
    assert client.responses.retrieve(streamed.id).output_text == ANSWER
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_unknown_response_id_through_the_proxy(cluster, method):
    r = httpx.request(method, f"{cluster[0]}/responses/resp_unknown", timeout=30)
    assert r.status_code == 404
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "NotFoundError" and "resp_unknown" in error["message"]


def test_unknown_previous_response_id_through_the_proxy(cluster):
    r = httpx.post(f"{cluster[0]}/responses", timeout=30, json={
        "model": MODEL, "input": "x", "previous_response_id": "resp_unknown"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_background_resume_and_cancel_through_the_proxy(cluster):
    """A streamed background response through the proxy: resumed with `starting_after`
    (its query forwarded, the answer relayed as SSE) and cancelled (forwarded; it had
    finished, so it comes back unchanged) on the decode server that holds it."""
    url = cluster[0]
    first = _events(httpx.post(f"{url}/responses", timeout=60, json={
        "model": MODEL, "input": "Hello?", "background": True, "stream": True}).text)
    rid = first[0]["response"]["id"]
    assert first[-1]["type"] == "response.completed"
    resumed = httpx.get(f"{url}/responses/{rid}?stream=true&starting_after=2", timeout=60)
    assert resumed.headers["content-type"].startswith("text/event-stream")
    assert _events(resumed.text) == first[3:]
    cancelled = httpx.post(f"{url}/responses/{rid}/cancel", timeout=60)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "completed"
