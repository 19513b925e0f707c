"""`--tool-server` and a request's `{"type": "mcp"}` entries (kvrelay/server/mcp/servers.py):
the flag's forms and errors, URL normalisation, and which entries resolve to an allowed
server — exact values, no connection made."""
from __future__ import annotations

import pytest

from kvrelay.server.mcp.servers import ToolServer, normalise_url, parse_tool_servers, resolve
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.tools import AgentOptions


def test_the_flag():
    assert parse_tool_servers("calc=127.0.0.1:8001, HTTPS://Example.COM:443/x/") == (
        ToolServer("calc", "http://127.0.0.1:8001/mcp"), ToolServer(None, "https://example.com/x"))
    assert parse_tool_servers("py=http://[::1]:9000/mcp") == (
        ToolServer("py", "http://[::1]:9000/mcp"),)
    assert parse_tool_servers(None) == parse_tool_servers("") == ()
    for bad, words in (("demo", "no demo tools"), ("a b=h:1", "label"), ("x=h:99999", "port"),
                       ("a=h:1,a=h:2", "twice"), ("ftp://h:1", r"http\(s\)"),
                       ("http://u:p@h:1/mcp", "no user")):
        with pytest.raises(ValueError, match=words):
            parse_tool_servers(bad)
    with pytest.raises(ValueError, match="--tool-server-timeout"):
        AgentOptions(tool_server_timeout_s=0)
    with pytest.raises(ValueError, match="--tool-server-max-calls"):
        AgentOptions(tool_server_max_calls=0)


def test_urls_compare_in_one_spelling():
    assert normalise_url("http://H:80") == normalise_url("http://h/mcp/") == "http://h/mcp"
    assert normalise_url("http://h:8080/a") != normalise_url("http://h:8081/a")


ALLOWED = parse_tool_servers("calc=127.0.0.1:8001,http://10.0.0.5:9000/tools")


def test_entries_resolve_to_allowed_servers_only():
    base = {"type": "mcp", "server_label": "x", "require_approval": "never"}
    by_url = resolve({**base, "server_url": "http://10.0.0.5:9000/tools/"}, "tools[0]", ALLOWED)
    assert (by_url.label, by_url.url) == ("x", "http://10.0.0.5:9000/tools")
    by_label = resolve({**base, "server_label": "calc", "headers": {"X-A": "1"},
                        "authorization": "tok", "allowed_tools": {"tool_names": ["add"]}},
                       "tools[0]", ALLOWED)
    assert by_label.url == "http://127.0.0.1:8001/mcp"
    assert by_label.headers == {"X-A": "1", "Authorization": "Bearer tok"}
    assert by_label.allows("add", None) and not by_label.allows("echo", None)
    assert by_label.as_response_tool()["headers"] is None
    assert "authorization" not in by_label.as_response_tool()
    read_only = resolve({**base, "server_label": "calc", "allowed_tools": {"read_only": True}},
                        "tools[0]", ALLOWED)
    assert read_only.allows("get", {"readOnlyHint": True}) and not read_only.allows("set", {})
    # require_approval: "always" when left out (OpenAI's default), per tool with filters
    asks = resolve({k: v for k, v in base.items() if k != "require_approval"}
                   | {"server_label": "calc"}, "tools[0]", ALLOWED)
    assert asks.asks("add", None) and not by_label.asks("add", None)
    mixed = resolve({**base, "server_label": "calc", "require_approval": {
        "always": {"tool_names": ["rm"]}, "never": {"read_only": True}}}, "tools[0]", ALLOWED)
    assert mixed.asks("rm", {"readOnlyHint": True}) and mixed.asks("set", {})
    assert not mixed.asks("get", {"readOnlyHint": True})
    for entry in ({**base, "server_url": "http://10.0.0.5:9000/other"},
                  {**base, "server_url": "http://10.0.0.6:9000/tools"},
                  {**base},                                          # no URL, no such label
                  {**base, "server_label": "a.b"},
                  {**base, "server_label": "calc", "require_approval": "sometimes"},
                  {**base, "server_label": "calc", "require_approval": {"always": "add"}},
                  {**base, "server_label": "calc", "allowed_tools": "add"},
                  {**base, "server_label": "calc", "headers": {"X": 1}}):
        with pytest.raises(OpenAIError) as e:
            resolve(entry, "tools[0]", ALLOWED)
        assert e.value.status == 400 and e.value.param.startswith("tools[0]")
    with pytest.raises(OpenAIError, match="--tool-server"):
        resolve({**base, "server_url": "http://127.0.0.1:8001/mcp"}, "tools[0]", ())


def test_the_output_cap_flag_and_variable(monkeypatch):
    from kvrelay.cli import agent_options, build_parser
    monkeypatch.delenv("KVRELAY_TOOL_SERVER_MAX_OUTPUT_BYTES", raising=False)

    def cap(*flags: str) -> int:
        return agent_options(build_parser().parse_args(["serve", *flags])) \
            .tool_server_max_output_bytes
    assert cap() == 64 << 10
    assert cap("--tool-server-max-output-bytes", "4096") == 4096
    monkeypatch.setenv("KVRELAY_TOOL_SERVER_MAX_OUTPUT_BYTES", "8192")
    assert cap() == 8192 and cap("--tool-server-max-output-bytes", "4096") == 4096
    with pytest.raises(ValueError, match="--tool-server-max-output-bytes"):
        cap("--tool-server-max-output-bytes", "10")
