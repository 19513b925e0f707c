"""MCP tools in /v1/responses, in process: the real openai client, a scripted harmony model
(tests/agent/fakes.py) and a real MCP server (tests/agent/mcp_server.py, in a thread): the
full loop (list → the model calls add → mcp_call with its output → the model answers with
it), streamed and not, the allowlist's 400s, a timeout, the MCP server's errors, a server
that is down, the bound on calls, and a forced call (tool_choice type mcp). Approvals,
background runs, the output cap and the built-in tools: test_mcp_more.py."""
from __future__ import annotations

import json
import re
import time

import pytest

from kvrelay.harmony import get_encoding
from kvrelay.server.mcp.servers import parse_tool_servers
from kvrelay.server.tools import AgentOptions
from kvrelay.structured.params import FunctionSpec
from tests.agent.fakes import MODEL, ScriptedEngine, make_state, openai_client
from tests.agent.mcp_server import McpThread
from tests.harmony_factories import scripted_harmony_answer, scripted_tool_call
from tests.processes import free_port
from tests.proxy.fakes import refused_port

RESULT = re.compile(r"<\|start\|>functions\.(\w+) to=assistant<\|channel\|>commentary"
                    r"<\|message\|>(.*?)<\|end\|>", re.S)


@pytest.fixture(scope="module")
def mcp_url():
    server = McpThread(free_port()).start()
    try:
        yield server.url
    finally:
        server.stop()


def _text(ids: list[int]) -> str:
    return get_encoding().decode(ids)


def _model(call: str, args: str, answer: str = "The result is {}.", repeat: bool = False):
    """A scripted gpt-oss: calls `call(args)` until the prompt holds a tool result (always,
    with `repeat`), then answers `answer` with the last result in it."""
    def script(prompt: list[int]) -> list[int]:
        results = RESULT.findall(_text(prompt))
        if results and not repeat:
            return scripted_harmony_answer("", answer.format(results[-1][1]))
        return scripted_tool_call(call, args, reasoning="I'll use the tool.")
    return ScriptedEngine(script, lambda ids: get_encoding().decode(
        [i for i in ids if i < 199998]))


def _client(engine, mcp_url: str, **options):
    agent = AgentOptions(tool_servers=parse_tool_servers(f"calc={mcp_url}"), **options)
    return openai_client(make_state(engine, True, agent))


CALC = {"type": "mcp", "server_label": "calc", "require_approval": "never"}


def test_the_full_loop(mcp_url):
    engine = _model("add", '{"a":2,"b":3}')
    client, _ = _client(engine, mcp_url)
    out = client.responses.create(model=MODEL, input="What is 2 + 3?",
                                  tools=[{**CALC, "server_url": mcp_url}])
    assert out.status == "completed"
    listed, reasoning, call, message = out.output
    assert listed.type == "mcp_list_tools" and listed.server_label == "calc"
    assert listed.error is None and [t.name for t in listed.tools] == ["add", "echo", "slow",
                                                                       "fail"]
    assert listed.tools[0].input_schema["required"] == ["a", "b"]
    assert reasoning.type == "reasoning"
    assert (call.type, call.server_label, call.name, call.arguments) == (
        "mcp_call", "calc", "add", '{"a":2,"b":3}')
    assert (call.output, call.error, call.status) == ("5", None, "completed")
    assert call.id.startswith("mcp_")
    assert message.type == "message" and out.output_text == "The result is 5."
    # two model calls: the tools offered as functions both times, the result fed back once
    (first, _), (second, _) = engine.requests
    assert "namespace functions" in _text(first) and "type add = " in _text(first)
    assert RESULT.findall(_text(second)) == [("add", "5")]
    assert out.usage.input_tokens == len(first) + len(second)
    assert out.usage.output_tokens == len(scripted_tool_call(
        "add", '{"a":2,"b":3}', reasoning="I'll use the tool.")) + len(
        scripted_harmony_answer("", "The result is 5."))
    # echoed as sent (no headers), and continued: the call and its result are history
    assert [t.type for t in out.tools] == ["mcp"] and out.tools[0].headers is None
    engine.script = lambda prompt: scripted_harmony_answer("", "ok")
    client.responses.create(model=MODEL, input="Thanks", previous_response_id=out.id)
    assert RESULT.findall(_text(engine.requests[-1][0])) == [("add", "5")]


def test_the_loop_streamed(mcp_url):
    client, _ = _client(_model("add", '{"a":20,"b":22}'), mcp_url)
    events = list(client.responses.create(model=MODEL, input="20 + 22?", tools=[CALC],
                                          stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    mcp_kinds = [k for k in kinds if "mcp" in k]
    assert mcp_kinds[:2] == ["response.mcp_list_tools.in_progress",
                             "response.mcp_list_tools.completed"]
    assert mcp_kinds[-3:] == ["response.mcp_call_arguments.done", "response.mcp_call.in_progress",
                              "response.mcp_call.completed"]
    args = "".join(e.delta for e in events if e.type == "response.mcp_call_arguments.delta")
    assert args == '{"a":20,"b":22}'
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == sorted(done) == [0, 1, 2, 3]
    assert done[2].type == "mcp_call" and done[2].output == "42"
    final = events[-1]
    assert final.type == "response.completed"
    assert [it.model_dump() for it in final.response.output] == [
        done[i].model_dump() for i in range(4)]
    assert final.response.output_text == "The result is 42."


def test_the_allowlist(mcp_url):
    _, http = _client(_model("add", "{}"), mcp_url)

    def error(tool: dict) -> dict:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [tool]})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    for url in ("http://169.254.169.254/latest/meta-data", "http://127.0.0.1:1/mcp",
                mcp_url.replace("/mcp", "/other"), "file:///etc/passwd", 7):
        err = error({**CALC, "server_url": url})
        assert err["param"] == "tools[0].server_url" and "--tool-server" in err["message"]
    assert "labelled 'other'" in error({**CALC, "server_label": "other"})["message"]
    for approval in ("sometimes", {"always": 5}, {"later": {}}):
        err = error({**CALC, "require_approval": approval})
        assert err["param"].startswith("tools[0].require_approval")
    assert "connector" in error({**CALC, "connector_id": "connector_gmail"})["message"]
    # the same name from an MCP server and the request's functions
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [
        CALC, {"type": "function", "name": "add", "parameters": {"type": "object"}}]})
    assert r.status_code == 400 and "'add'" in r.json()["error"]["message"]
    # a server without --tool-server refuses every MCP entry
    _, bare = openai_client(make_state(_model("add", "{}"), True, AgentOptions()))
    r = bare.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [CALC]})
    assert r.status_code == 400 and "--tool-server" in r.json()["error"]["message"]


def test_allowed_tools_filter_what_is_listed_and_offered(mcp_url):
    engine = _model("echo", '{"text":"hi"}')
    client, _ = _client(engine, mcp_url)
    out = client.responses.create(model=MODEL, input="Say hi", tools=[
        {**CALC, "allowed_tools": ["echo"]}])
    assert [t.name for t in out.output[0].tools] == ["echo"]
    assert "type echo = " in _text(engine.requests[0][0])
    assert "type add = " not in _text(engine.requests[0][0])
    assert out.output[2].output == "hi" and out.output_text == "The result is hi."


def test_a_timeout_is_the_calls_error(mcp_url):
    client, _ = _client(_model("slow", '{"seconds": 5}'), mcp_url, tool_server_timeout_s=0.5)
    start = time.monotonic()
    out = client.responses.create(model=MODEL, input="x", tools=[CALC])
    assert time.monotonic() - start < 4
    call = out.output[2]
    assert call.status == "failed" and call.output is None
    assert call.error.type == "http_error" and call.error.code == 504
    assert "0.5 s" in call.error.message
    assert out.status == "completed"          # the model was told, and answered


def test_the_servers_errors_are_the_calls_error(mcp_url):
    client, _ = _client(_model("fail", '{"text": "please"}'), mcp_url)
    out = client.responses.create(model=MODEL, input="x", tools=[CALC])
    call = out.output[2]
    assert call.status == "failed" and call.error.type == "mcp_tool_execution_error"
    assert "fail was asked to fail: please" in json.dumps(call.error.content)
    # arguments that are not JSON: not sent, an error the model sees
    client, _ = _client(_model("add", "not json"), mcp_url)
    call = client.responses.create(model=MODEL, input="x", tools=[CALC]).output[2]
    assert call.error.type == "mcp_protocol_error" and call.error.code == -32602


def test_a_server_that_is_down_lists_nothing():
    sock, port = refused_port()
    try:
        engine = _model("add", "{}")
        client, _ = openai_client(make_state(engine, True, AgentOptions(
            tool_servers=parse_tool_servers(f"calc=127.0.0.1:{port}"))))
        out = client.responses.create(model=MODEL, input="x", tools=[CALC])
    finally:
        sock.close()
    listed = out.output[0]
    assert listed.type == "mcp_list_tools" and listed.tools == []
    assert listed.error and "502" in listed.error
    assert "namespace functions" not in _text(engine.requests[0][0])   # nothing offered
    # the model's call of a tool nobody offers stays text (no call is made)
    assert [it.type for it in out.output[1:]] == ["reasoning", "message"]


def test_the_loop_is_bounded(mcp_url):
    client, _ = _client(_model("add", '{"a":1,"b":1}', repeat=True), mcp_url)
    out = client.responses.create(model=MODEL, input="x", tools=[CALC], extra_body={
        "max_tool_calls": 2})
    calls = [it for it in out.output if it.type == "mcp_call"]
    assert [c.status for c in calls] == ["completed", "completed", "incomplete"]
    assert calls[2].output is None and "not called" in calls[2].error.message
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_tool_calls"
    client, _ = _client(_model("add", '{"a":1,"b":1}', repeat=True), mcp_url,
                        tool_server_max_calls=1)
    out = client.responses.create(model=MODEL, input="x", tools=[CALC], max_output_tokens=500)
    assert [c.status for c in out.output if c.type == "mcp_call"] == ["completed", "incomplete"]
    # the output budget spans the rounds
    client, _ = _client(_model("add", '{"a":1,"b":1}', repeat=True), mcp_url)
    one_round = len(scripted_tool_call("add", '{"a":1,"b":1}', reasoning="I'll use the tool."))
    out = client.responses.create(model=MODEL, input="x", tools=[CALC],
                                  max_output_tokens=one_round + 5)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == one_round + 5


def test_tool_choice_mcp_forces_the_first_call_only(mcp_url):
    engine = _model("add", '{"a":2,"b":2}')
    client, _ = _client(engine, mcp_url)
    out = client.responses.create(model=MODEL, input="x", tools=[CALC], tool_choice={
        "type": "mcp", "server_label": "calc", "name": "add"})
    assert out.output_text == "The result is 4."
    first, second = (params.structured_outputs for _, params in engine.requests)
    assert first.tool_call.functions[0] == FunctionSpec("add", first.tool_call.functions[0]
                                                        .parameters)
    assert len(first.tool_call.functions) == 1 and second is None
    assert out.tool_choice.type == "mcp"            # echoed as sent
