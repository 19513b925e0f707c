"""MCP in /v1/responses beyond the plain loop (test_mcp_loop.py), in process: the real openai
client, a scripted gpt-oss (tests/agent/fakes.py) and real MCP servers in threads
(tests/agent/mcp_server.py):
- approvals: `require_approval` "always" (OpenAI's default) ends the response with an
  `mcp_approval_request`; an `mcp_approval_response` with `previous_response_id` makes (or
  declines) the call; unknown ids are 400s; the per-tool filters;
- the tool-output cap: a result over --tool-server-max-output-bytes is cut (and says so), an
  answer of megabytes is not read at all;
- background: the loop runs in the background task, polled to completed; cancelled while a
  call is in flight it ends `cancelled` at once, the call abandoned, nothing left running;
- gpt-oss's built-in browser / python on the --tool-server entries labelled so:
  `web_search_call` / `code_interpreter_call` items, the result fed back under the tool's
  own author (`<|start|>browser.search to=assistant`), streamed, continued, refused (400)
  without such an entry."""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from starlette.testclient import TestClient

from kvrelay.harmony import get_encoding
from kvrelay.server.api import build_app
from kvrelay.server.mcp.servers import parse_tool_servers
from kvrelay.server.tools import AgentOptions
from tests.agent.fakes import MODEL, ScriptedEngine, make_state, openai_client
from tests.agent.mcp_server import McpThread, build_builtin
from tests.harmony_factories import scripted_harmony_answer, scripted_tool_call
from tests.processes import free_port

RESULT = re.compile(r"<\|start\|>functions\.(\w+) to=assistant<\|channel\|>commentary"
                    r"<\|message\|>(.*?)<\|end\|>", re.S)
BUILTIN_RESULT = re.compile(r"<\|start\|>(browser\.\w+|python) to=assistant<\|channel\|>"
                            r"analysis<\|message\|>(.*?)<\|end\|>", re.S)
CALC = {"type": "mcp", "server_label": "calc"}           # require_approval left out: "always"


@pytest.fixture(scope="module")
def urls():
    calc = McpThread(free_port()).start()
    tools = McpThread(free_port(), build_builtin).start()
    try:
        yield calc.url, tools.url
    finally:
        calc.stop()
        tools.stop()


def _text(ids: list[int]) -> str:
    return get_encoding().decode(ids)


def _engine(script) -> ScriptedEngine:
    return ScriptedEngine(script, lambda ids: get_encoding().decode(
        [i for i in ids if i < 199998]))


def _calls(call: str, args: str):
    """Calls `call(args)` until a tool result is in the prompt, then answers with it."""
    def script(prompt: list[int]) -> list[int]:
        text = _text(prompt)
        results = RESULT.findall(text)
        if results and "declined" in results[-1][1]:
            return scripted_harmony_answer("", "You declined.")
        if results:
            return scripted_harmony_answer("", f"The result is {results[-1][1]}.")
        return scripted_tool_call(call, args, reasoning="I'll use the tool.")
    return _engine(script)


def _options(urls, **kw) -> AgentOptions:
    calc, tools = urls
    return AgentOptions(tool_servers=parse_tool_servers(
        f"calc={calc},web={tools},browser={tools},python={tools}"), **kw)


# ------------------------------------------------------------------ approvals


def test_an_approval_request_then_the_approved_call(urls):
    engine = _calls("add", '{"a":2,"b":3}')
    client, _ = openai_client(make_state(engine, True, _options(urls)))
    asked = client.responses.create(model=MODEL, input="2 + 3?", tools=[CALC])
    assert asked.status == "completed"
    listed, _, request = asked.output
    assert (request.type, request.server_label, request.name, request.arguments) == (
        "mcp_approval_request", "calc", "add", '{"a":2,"b":3}')
    assert len(engine.requests) == 1                      # asked: nothing called, no round 2
    done = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[CALC],
                                   input=[{"type": "mcp_approval_response", "approve": True,
                                           "approval_request_id": request.id}])
    listed, call, message = done.output
    assert (listed.type, message.type) == ("mcp_list_tools", "message")
    assert (call.type, call.approval_request_id, call.output, call.status) == (
        "mcp_call", request.id, "5", "completed")
    assert done.output_text == "The result is 5."
    assert RESULT.findall(_text(engine.requests[-1][0])) == [("add", "5")]
    # streamed: the request is an item of its own, without argument events
    events = list(client.responses.create(model=MODEL, input="2 + 3?", tools=[CALC],
                                          stream=True))
    kinds = [e.type for e in events]
    assert not [k for k in kinds if "arguments" in k or "mcp_call" in k]
    done_items = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done_items == ["mcp_list_tools", "reasoning", "mcp_approval_request"]
    assert events[-1].response.output[-1].arguments == '{"a":2,"b":3}'


def test_declined_unknown_and_filtered_approvals(urls):
    engine = _calls("add", '{"a":1,"b":1}')
    client, http = openai_client(make_state(engine, True, _options(urls)))
    asked = client.responses.create(model=MODEL, input="1 + 1?", tools=[
        {**CALC, "require_approval": "always"}])
    rid = asked.output[-1].id
    declined = client.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=[CALC], input=[
            {"type": "mcp_approval_response", "approve": False, "approval_request_id": rid,
             "reason": "not now"}])
    assert [it.type for it in declined.output] == ["mcp_list_tools", "message"]
    assert declined.output_text == "You declined."
    assert "the user declined this call: not now" in _text(engine.requests[-1][0])

    def refused(body: dict) -> dict:
        r = http.post("/v1/responses", json={"model": MODEL, **body},
                      headers={"Authorization": "Bearer x"})     # the owner of `asked`
        assert r.status_code == 400, r.text
        return r.json()["error"]
    answer = {"type": "mcp_approval_response", "approve": True, "approval_request_id": "mcpr_x"}
    err = refused({"previous_response_id": asked.id, "tools": [CALC], "input": [answer]})
    assert err["param"] == "input[0].approval_request_id" and err["type"] == "BadRequestError"
    answer["approval_request_id"] = rid
    assert "answered already" in refused({"previous_response_id": asked.id, "tools": [CALC],
                                          "input": [answer, answer]})["message"]
    assert refused({"previous_response_id": asked.id, "input": [answer]})["param"] == "input[0]"
    # another client cannot approve (and so run) a call the owner's response asked about
    calls_before = len(engine.requests)
    other = http.post("/v1/responses", headers={"Authorization": "Bearer someone-else"},
                      json={"model": MODEL, "previous_response_id": asked.id, "tools": [CALC],
                            "input": [answer]})
    assert other.status_code in (400, 404) and "error" in other.json(), other.text
    assert len(engine.requests) == calls_before                   # nothing ran for them
    # the approval request may come back in the input instead of previous_response_id
    out = client.responses.create(model=MODEL, tools=[CALC], input=[
        {"role": "user", "content": "1 + 1?"}, asked.output[-1].model_dump(), answer])
    assert out.output[1].approval_request_id == rid and out.output_text == "The result is 2."
    # per tool: add never asks, echo always does
    per_tool = {**CALC, "require_approval": {"never": {"tool_names": ["add"]}}}
    assert client.responses.create(model=MODEL, input="1 + 1?", tools=[per_tool]
                                   ).output_text == "The result is 2."
    per_tool["require_approval"] = {"always": ["add"], "never": {}}
    assert client.responses.create(model=MODEL, input="1 + 1?", tools=[per_tool]
                                   ).output[-1].type == "mcp_approval_request"


# ------------------------------------------------------------------ the output cap


def test_a_tool_result_is_cut_at_the_cap(urls):
    web = {"type": "mcp", "server_label": "web", "require_approval": "never"}
    engine = _calls("search", '{"query":"flood:200000"}')
    client, _ = openai_client(make_state(engine, True, _options(
        urls, tool_server_max_output_bytes=1000)))
    call = client.responses.create(model=MODEL, input="x", tools=[web]).output[2]
    assert call.status == "completed" and len(call.output.encode()) <= 1000
    assert call.output.startswith("xxx") and "cut from 200000 to 1000 bytes" in call.output
    assert "cut from 200000" in _text(engine.requests[-1][0])
    # an answer far over the cap is not read: the call fails, the model is told
    engine = _calls("search", '{"query":"flood:3000000"}')
    client, _ = openai_client(make_state(engine, True, _options(
        urls, tool_server_max_output_bytes=1000)))
    call = client.responses.create(model=MODEL, input="x", tools=[web]).output[2]
    assert call.status == "failed" and call.error.code == 502
    assert "larger than" in call.error.message and call.output is None
    with pytest.raises(ValueError, match="max-output-bytes"):
        AgentOptions(tool_server_max_output_bytes=10)


# ------------------------------------------------------------------ background


def test_background_mcp_is_polled_and_cancelled_mid_call(urls):
    engine = _calls("slow", '{"seconds": 0.2}')
    state = make_state(engine, True, _options(urls))
    app = build_app(state)
    slow = {**CALC, "require_approval": "never"}
    with TestClient(app, base_url="http://testserver") as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [slow],
                                             "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued"
        rid = r.json()["id"]
        deadline = time.monotonic() + 30
        while (body := http.get(f"/v1/responses/{rid}").json())["status"] != "completed":
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        call = body["output"][2]
        assert (call["type"], call["output"], call["status"]) == ("mcp_call", "slept",
                                                                  "completed")
        assert body["output"][-1]["content"][0]["text"] == "The result is slept."

        async def tasks() -> set[str]:
            return {t.get_name() for t in asyncio.all_tasks()}
        before = http.portal.call(tasks)
        engine.script = _calls("slow", '{"seconds": 30}').script
        start = time.monotonic()
        with http.stream("POST", "/v1/responses", json={
                "model": MODEL, "input": "x", "tools": [slow], "background": True,
                "stream": True}) as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    rid = event.get("response", {}).get("id", rid)
                    if event["type"] == "response.mcp_call.in_progress":
                        break
        cancelled = http.post(f"/v1/responses/{rid}/cancel").json()
        assert time.monotonic() - start < 10                # the 30 s call was abandoned
        assert cancelled["status"] == "cancelled"
        call = cancelled["output"][2]
        assert (call["type"], call["status"], call["output"]) == ("mcp_call", "incomplete",
                                                                  None)
        assert http.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        assert len(app.state.background_responses) == 0
        assert http.portal.call(tasks) <= before           # no task left running


# ------------------------------------------------------------------ built-in tools


def _builtin_call(recipient: str, args: str) -> list[int]:
    kind = "code" if recipient == "python" else "<|constrain|>json"
    return get_encoding().encode(
        f"<|channel|>analysis<|message|>Let me look.<|end|><|start|>assistant"
        f"<|channel|>analysis to={recipient} {kind}<|message|>{args}<|call|>",
        allowed_special="all")


def _uses(recipient: str, args: str):
    def script(prompt: list[int]) -> list[int]:
        results = BUILTIN_RESULT.findall(_text(prompt))
        if results:
            return scripted_harmony_answer("", f"Found: {results[-1][1][:40]}")
        return _builtin_call(recipient, args)
    return _engine(script)


def test_the_browser_on_an_mcp_server(urls):
    engine = _uses("browser.search", '{"query":"why is the sky blue"}')
    client, _ = openai_client(make_state(engine, True, _options(urls)))
    out = client.responses.create(model=MODEL, input="Why is the sky blue?",
                                  tools=[{"type": "web_search_preview"}])
    assert [it.type for it in out.output] == ["reasoning", "web_search_call", "message"]
    call = out.output[1]
    assert call.status == "completed" and call.id.startswith("ws_")
    assert (call.action.type, call.action.query) == ("search", "why is the sky blue")
    first, second = (_text(ids) for ids, _ in engine.requests)
    assert "namespace browser {" in first and "## python" not in first
    assert "namespace functions" not in first
    assert "to=browser.search" in second
    assert BUILTIN_RESULT.findall(second) == [
        ("browser.search", "[0] Result for why is the sky blue: the sky is blue "
                           "(https://example.com/sky)")]
    assert out.output_text.startswith("Found: [0] Result for why")
    assert [t.type for t in out.tools] == ["web_search_preview"]
    # continued: the answer stays; the browsing before it was chain of thought, which
    # harmony drops from answered turns
    engine.script = lambda prompt: scripted_harmony_answer("", "ok")
    client.responses.create(model=MODEL, input="Thanks", previous_response_id=out.id,
                            tools=[{"type": "web_search_preview"}])
    last = _text(engine.requests[-1][0])
    assert "<|channel|>final<|message|>Found: [0] Result" in last
    assert not BUILTIN_RESULT.findall(last)
    # streamed: OpenAI's web search events around the call
    engine = _uses("browser.open", '{"id":"https://example.com/sky"}')
    client, _ = openai_client(make_state(engine, True, _options(urls)))
    events = list(client.responses.create(model=MODEL, input="x", stream=True,
                                          tools=[{"type": "web_search_preview"}]))
    kinds = [e.type for e in events if "web_search" in e.type]
    assert kinds == ["response.web_search_call.in_progress", "response.web_search_call.searching",
                     "response.web_search_call.completed"]
    call = events[-1].response.output[1]
    assert (call.action.type, call.action.url) == ("open_page", "https://example.com/sky")


def test_the_python_tool_on_an_mcp_server(urls):
    engine = _uses("python", "6 * 7")
    client, _ = openai_client(make_state(engine, True, _options(urls)))
    events = list(client.responses.create(model=MODEL, input="6 * 7?", stream=True, tools=[
        {"type": "code_interpreter", "container": {"type": "auto"}}]))
    out = events[-1].response
    call = out.output[1]
    assert (call.type, call.code, call.status) == ("code_interpreter_call", "6 * 7", "completed")
    assert [(o.type, o.logs) for o in call.outputs] == [("logs", "42")]
    code = "".join(e.delta for e in events if e.type == "response.code_interpreter_call_code.delta")
    assert code == "6 * 7"
    assert "response.code_interpreter_call.interpreting" in [e.type for e in events]
    first, second = (_text(ids) for ids, _ in engine.requests)
    assert "## python" in first and "namespace browser" not in first
    assert BUILTIN_RESULT.findall(second) == [("python", "42")]
    assert out.output_text == "Found: 42"
    # its items sent back as input (the Agents SDK's way without previous_response_id)
    engine.script = lambda prompt: scripted_harmony_answer("", "ok")
    again = client.responses.create(model=MODEL, tools=[{"type": "code_interpreter"}], input=[
        {"role": "user", "content": "6 * 7?"}, *[it.model_dump() for it in out.output],
        {"role": "user", "content": "Thanks"}])
    assert again.output_text == "ok"


def test_builtin_tools_need_their_tool_server(urls):
    calc, _ = urls
    _, http = openai_client(make_state(_uses("python", "1"), True, AgentOptions(
        tool_servers=parse_tool_servers(f"calc={calc}"))))
    for tool in ({"type": "web_search_preview"}, {"type": "code_interpreter"}):
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [tool]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
        assert "labelled" in r.json()["error"]["message"]
    # a calc server is no browser: it lists no search / open / find
    _, http = openai_client(make_state(_uses("python", "1"), True, AgentOptions(
        tool_servers=parse_tool_servers(f"browser={calc}"))))
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x",
                                         "tools": [{"type": "web_search_preview"}]})
    assert r.status_code == 400 and "search, open, find" in r.json()["error"]["message"]
