"""An MCP round trip through a real `kvrelay serve` (the tiny random-weight o200k gpt-oss,
`--tool-server calc=...`) and a real MCP server process (tests/agent/mcp_server.py): the
server lists the tools, the call the request forces (tool_choice type mcp: the grammar makes
the random model write a schema-valid `add` call) is made on the MCP server, and its output
is the sum of the arguments the model wrote."""
from __future__ import annotations

import json

import openai
import pytest

from tests.agent.conftest import MODEL
from tests.agent.mcp_server import McpProcess
from tests.processes import Server, free_port


@pytest.fixture(scope="module")
def served(o200k_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mcp-e2e")
    mcp = McpProcess(free_port(), logs / "mcp.log").start()
    server = Server(str(o200k_checkpoint),
                    ["--dtype", "float32", "--max-model-len", "1024", "--served-model-name",
                     MODEL, "--tool-server", f"calc=127.0.0.1:{mcp.port}"],
                    logs / "serve.log")
    try:
        server.wait_ready()
        yield server, mcp
    finally:
        server.stop()
        mcp.stop()


def test_an_mcp_round_trip(served):
    server, mcp = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.responses.create(
        model=MODEL, input="What is 2 + 3? Use the calculator.", max_output_tokens=96,
        tools=[{"type": "mcp", "server_label": "calc", "server_url": mcp.url,
                "require_approval": "never", "allowed_tools": ["add", "echo"]}],
        tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    listed = out.output[0]
    assert listed.type == "mcp_list_tools" and listed.error is None
    assert sorted(t.name for t in listed.tools) == ["add", "echo"]
    call = next(it for it in out.output if it.type == "mcp_call")
    assert (call.server_label, call.name) == ("calc", "add")
    args = json.loads(call.arguments)
    assert (call.status, call.error, call.output) == ("completed", None, str(args["a"] + args["b"]))
    assert out.status in ("completed", "incomplete")     # a random model's answer after it
    assert out.usage.output_tokens <= 96 and out.usage.input_tokens > 0
    # a server_url not on --tool-server is refused before anything is connected to
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", tools=[{
            "type": "mcp", "server_label": "calc", "server_url": "http://127.0.0.1:9/mcp",
            "require_approval": "never"}])
