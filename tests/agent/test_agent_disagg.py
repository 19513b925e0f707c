"""Function calling through `kvrelay proxy` in 1P1D (prefill + decode with vLLM's tool flags,
the scripted engine of tests/agent/scripted.py on the tiny o200k checkpoint): the openai
client's tool calls, streamed and not, the tool-result turn, an Agents SDK agent through
the Chat Completions model class, the Responses API (create, stream, previous_response_id,
GET and DELETE) and MCP tools (the server's tool loop against a real MCP server, approvals
answered with previous_response_id and statelessly; no KV left held on either server)
through the proxy."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvrelay.proxy.responses import prefill_body
from tests.agent.conftest import (
    AGENT_FLAGS,
    ANSWER,
    CALL_ARGS,
    MODEL,
    WEATHER_SCHEMA,
    agent_scripts,
)
from tests.agent.mcp_server import McpThread, build_weather
from tests.e2e.disagg import start
from tests.processes import KvrelayProcess, free_port

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]


@pytest.fixture(scope="module")
def weather():
    """An MCP server (in a thread of this process) serving `get_weather`, the tool the
    scripted model calls: (its URL, the arguments of every call it received)."""
    seen: list[dict] = []
    server = McpThread(free_port(), lambda: build_weather(seen)).start()
    try:
        yield server.url, seen
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(o200k_checkpoint, tmp_path_factory, weather):
    """(proxy base url, prefill server, decode server); both servers have the MCP server of
    `weather` on --tool-server."""
    logs = tmp_path_factory.mktemp("agent-1p1d")
    flags = ["--max-model-len", "1024", "--served-model-name", MODEL, *AGENT_FLAGS,
             "--logits-processors", "tests.agent.scripted:agent_script",
             "--tool-server", f"weather={weather[0]}"]
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


# ------------------------------------------------------------------ MCP tools

HELD, BLOCKS = "kvrelay:kv_requests_held_for_remote", "kvrelay:kv_blocks_used"


def _mcp_tool(url: str, approval: str) -> dict:
    return {"type": "mcp", "server_label": "weather", "server_url": url,
            "require_approval": approval}


def _kv_held(server, timeout: float = 10) -> tuple[float, float]:
    """(requests held for a decode, KV blocks used) once both are 0, or after `timeout`
    seconds (far below the prefill's 120 s lease: a hold nobody reads stays)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m.get(HELD, 0), m[BLOCKS]) == (0, 0) or time.monotonic() > deadline:
            return m.get(HELD, 0), m[BLOCKS]
        time.sleep(0.2)


def _nothing_held(prefill, decode) -> None:
    assert _kv_held(prefill) == (0, 0) and _kv_held(decode) == (0, 0)


def test_mcp_tool_loop_through_the_proxy(cluster, weather):
    """require_approval "never": the prefill computes the first round's prompt (both servers
    list the tools), the decode pulls it, the model calls get_weather, the decode calls the
    MCP server and the model answers with its result; streamed, the MCP events come through."""
    url, prefill, decode = cluster
    mcp_url, seen = weather
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    tools = [_mcp_tool(mcp_url, "never")]
    before = prefill.metrics()[PROMPT_TOKENS], decode.metrics()[KV_PULLS], len(seen)
    out = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    assert out.status == "completed"
    assert [it.type for it in out.output] == ["mcp_list_tools", "reasoning", "mcp_call",
                                              "reasoning", "message"]
    listed, call = out.output[0], out.output[2]
    assert listed.error is None and [t.name for t in listed.tools] == ["get_weather"]
    assert (call.server_label, call.name, call.arguments, call.output, call.error) == (
        "weather", "get_weather", CALL_ARGS, "sunny", None)
    assert out.output_text == ANSWER
    assert seen[before[2]:] == [{"city": "Paris"}]          # called once, by the decode
    # the first round's prompt was the prefill's, pulled by the decode; the second (after
    # the call) the decode's own
    assert 0 < prefill.metrics()[PROMPT_TOKENS] - before[0] < out.usage.input_tokens
    assert decode.metrics()[KV_PULLS] == before[1] + 1

    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds.index("response.mcp_list_tools.completed") < \
        kinds.index("response.mcp_call.in_progress") < kinds.index("response.mcp_call.completed")
    assert streamed.output_text == ANSWER and seen[before[2]:] == [{"city": "Paris"}] * 2
    assert decode.metrics()[KV_PULLS] == before[1] + 2
    _nothing_held(prefill, decode)


def test_mcp_approval_through_the_proxy(cluster, weather):
    """require_approval "always": the response ends with an mcp_approval_request and nothing
    is called; approved with previous_response_id (to the decode that stored it) the call is
    made and answered. Approved statelessly (the request item in the input, store false),
    the decode makes the call before its first round, whose prompt then holds the result:
    the prefill is not asked (its KV would be read by nobody and held until its lease)."""
    url, prefill, decode = cluster
    mcp_url, seen = weather
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    tools = [_mcp_tool(mcp_url, "always")]
    called = len(seen)
    asked = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    assert asked.status == "completed"
    assert [it.type for it in asked.output] == ["mcp_list_tools", "reasoning",
                                                "mcp_approval_request"]
    request = asked.output[-1]
    assert (request.server_label, request.name, request.arguments) == (
        "weather", "get_weather", CALL_ARGS)
    assert len(seen) == called                              # asked: not called

    prefilled = prefill.metrics()[PROMPT_TOKENS]
    approval = {"type": "mcp_approval_response", "approve": True,
                "approval_request_id": request.id}
    done = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=tools,
                                   input=[approval])
    assert [it.type for it in done.output] == ["mcp_list_tools", "mcp_call", "reasoning",
                                               "message"]
    call = done.output[1]
    assert (call.approval_request_id, call.name, call.arguments, call.output, call.status) == (
        request.id, "get_weather", CALL_ARGS, "sunny", "completed")
    assert done.output_text == ANSWER and seen[called:] == [{"city": "Paris"}]

    history = [{"role": "user", "content": "Weather in Paris?"},
               *(it.model_dump(exclude_none=True) for it in asked.output)]
    stateless = client.responses.create(model=MODEL, input=[*history, approval], tools=tools,
                                        store=False)
    assert [it.type for it in stateless.output] == ["mcp_list_tools", "mcp_call", "reasoning",
                                                    "message"]
    assert stateless.output[1].output == "sunny" and stateless.output_text == ANSWER
    assert seen[called:] == [{"city": "Paris"}] * 2
    _nothing_held(prefill, decode)
    assert prefill.metrics()[PROMPT_TOKENS] == prefilled     # neither answer was prefilled


def test_a_prefilled_approval_answer_is_read_at_once(cluster, weather):
    """A proxy that sends every request through a prefill (vLLM's toy proxy; its two legs by
    hand here, with kvrelay proxy's prefill body): the decode of an approval answer makes
    the call before its first round, whose prompt is then not the prefilled one; it reads
    the prefill's KV at once all the same, so the prefill holds nothing after the response
    (before: held until its lease)."""
    url, prefill, decode = cluster
    mcp_url, seen = weather
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    tools = [_mcp_tool(mcp_url, "always")]
    asked = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools,
                                    store=False)
    body = {"model": MODEL, "tools": tools, "store": False, "input": [
        {"role": "user", "content": "Weather in Paris?"},
        *(it.model_dump(exclude_none=True) for it in asked.output),
        {"type": "mcp_approval_response", "approve": True,
         "approval_request_id": asked.output[-1].id}]}
    called, pulls = len(seen), decode.metrics()[KV_PULLS]
    first = httpx.post(f"{prefill.url}/v1/responses", json=prefill_body(body), timeout=60)
    assert first.status_code == 200, first.text
    kv = first.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] and seen[called:] == []        # the prefill calls nothing
    assert prefill.metrics()[HELD] == 1
    done = httpx.post(f"{decode.url}/v1/responses", json={**body, "kv_transfer_params": kv},
                      timeout=60)
    assert done.status_code == 200, done.text
    out = done.json()
    assert [it["type"] for it in out["output"]] == ["mcp_list_tools", "mcp_call", "reasoning",
                                                    "message"]
    assert out["output"][1]["output"] == "sunny" and seen[called:] == [{"city": "Paris"}]
    assert decode.metrics()[KV_PULLS] == pulls + 1                # the prefill's KV, read
    _nothing_held(prefill, decode)


# ------------------------------------------------ the random model, and a decode restart

def test_random_sampling_through_the_proxy_never_breaks_the_answer(cluster):
    """The random-weight model at temperature 1 (UNSCRIPTED: no script forces it) through
    the proxy, chat and Responses, streamed and not, with and without tools: every answer a
    200 that the openai client's types accept, ending with a finish reason / final status
    (issue 29's parser item, through 1P1D; the in-process fuzz is test_harmony_fuzz.py)."""
    url, prefill, decode = cluster
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    for seed in range(4):
        for tools in (None, TOOLS):
            extra = {"tools": tools} if tools else {}
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me UNSCRIPTED {seed}"}],
                temperature=1.0, seed=seed, max_tokens=24, **extra)
            assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say UNSCRIPTED {seed}"}],
                temperature=1.0, seed=seed, max_tokens=24, stream=True, **extra))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
            rtools = [{"type": "function", **t["function"]} for t in tools] if tools else []
            resp = client.responses.create(model=MODEL, input=f"Write UNSCRIPTED {seed}",
                                           temperature=1.0, max_output_tokens=24, tools=rtools,
                                           store=False)
            assert resp.status in ("completed", "incomplete")
            with client.responses.stream(model=MODEL, input=f"Note UNSCRIPTED {seed}",
                                         temperature=1.0, max_output_tokens=24, tools=rtools,
                                         store=False) as stream:
                kinds = [event.type for event in stream]
            assert kinds[0] == "response.created"
            assert kinds[-1] in ("response.completed", "response.incomplete")
    _nothing_held(prefill, decode)


def test_a_stored_response_survives_a_decode_restart_through_the_proxy(cluster, tmp_path):
    """The Responses store (SQLite, one file per port) through the proxy: a response stored
    on the decode server is still there, and still continues a conversation, after that
    server is stopped and started again on its port. (Last in this module: it restarts the
    module's decode server.)"""
    url, _, decode = cluster
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    first = client.responses.create(model=MODEL, input="Hello?")
    assert first.status == "completed" and first.output_text == ANSWER
    decode.stop()
    env = {"KVRELAY_AGENT_SCRIPTS": json.dumps(agent_scripts()), "UCX_NET_DEVICES": "lo",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    again = KvrelayProcess(list(decode.proc.args[3:]), tmp_path / "decode-again.log", env)
    try:
        again.wait_for_line("Application startup complete", 180)
        deadline = time.monotonic() + 30           # the proxy's health probe sees it back
        while True:                                # (the same key: the store is per owner)
            try:
                got = client.responses.retrieve(first.id)
                break
            except openai.APIStatusError as e:     # 502/503 while the proxy sees it down
                assert e.status_code != 404 and time.monotonic() < deadline, e
            time.sleep(0.5)
        assert got.id == first.id and got.output_text == ANSWER
        follow = client.responses.create(model=MODEL, input="And now?",
                                         previous_response_id=first.id)
        assert follow.previous_response_id == first.id and follow.output_text == ANSWER
        assert follow.usage.input_tokens > first.usage.input_tokens   # the history was in it
    finally:
        again.stop()
