"""Hostile grammars through every way a constraint reaches a live `kvrelay serve` (issue 26):
a 1,200-definition `$ref` chain, a 3,000-rule Lark chain and a 5,000-rule GBNF chain
(each crashed the API or the engine process with SIGSEGV), 10,000 choices, 20,000
alternatives and a 10^6-character choice (each answered 200 "stop" with text breaking
the constraint) are 400s with an OpenAI error body naming the field and the limit, via
response_format, structured_outputs, guided_*, the Responses API's text.format and a
tool's parameters; the server stays alive, /health answers and honest constrained
requests are served. One server (harmony checkpoint, o200k) for the module."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.processes import Server
from tests.structured import bombs
from tests.structured.conftest import harmony_ckpt  # noqa: F401  (the checkpoint fixture)
from tests.structured.schemas import CHOICES, WEATHER, valid_json

MODEL = "gpt-oss-tiny"
SCHEMAS = {"ref-chain": (bombs.ref_chain(1200), "MAX_SCHEMA_DEFINITIONS"),
           "ref-chain-300": (bombs.ref_chain(300), "MAX_SCHEMA_EXPANDED_DEPTH")}
GRAMMARS = {"lark-chain": (bombs.lark_chain(3000), "MAX_GRAMMAR_RULES"),
            "gbnf-chain": (bombs.gbnf_chain(5000), "MAX_GRAMMAR_RULES"),
            "alternatives": (bombs.alternatives(20_000), "MAX_ALTERNATIVES")}
CHOICE_LISTS = {"choices": (bombs.choices(10_000), "MAX_CHOICES"),
                "long-choice": (["x" * 10**6, "y"], "MAX_CHOICE_CHARS")}


@pytest.fixture(scope="module")
def server(harmony_ckpt, tmp_path_factory):  # noqa: F811
    s = Server(str(harmony_ckpt), ["--dtype", "float32", "--max-model-len", "8192",
                                   "--served-model-name", MODEL, "--enable-auto-tool-choice",
                                   "--tool-call-parser", "openai"],
               tmp_path_factory.mktemp("grammar-bombs") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _chat(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            **extra}


def _completion(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "prompt": "Hi", **extra}


def _response(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 8, "input": "Hi", "store": False, **extra}


def _tool(schema: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "bomb", "parameters": schema}}


def _cases() -> list[tuple[str, str, dict[str, Any], str, str]]:
    """(id, route, body, the param the 400 names, the limit its message names)"""
    cases = []
    for name, (schema, limit) in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        cases += [
            (f"chat-response_format-{name}", "/v1/chat/completions",
             _chat({"response_format": fmt}), "response_format", limit),
            (f"completion-response_format-{name}", "/v1/completions",
             _completion({"response_format": fmt}), "response_format", limit),
            (f"chat-structured_outputs-{name}", "/v1/chat/completions",
             _chat({"structured_outputs": {"json": schema}}), "structured_outputs", limit),
            (f"completion-guided_json-{name}", "/v1/completions",
             _completion({"guided_json": schema}), "guided_json", limit),
            (f"chat-guided_json-stream-{name}", "/v1/chat/completions",
             _chat({"guided_json": schema, "stream": True}), "guided_json", limit),
            (f"responses-text.format-{name}", "/v1/responses",
             _response({"text": {"format": {"type": "json_schema", "name": "x",
                                            "schema": schema}}}), "text.format", limit),
            (f"chat-tool-required-{name}", "/v1/chat/completions",
             _chat({"tools": [_tool(schema)], "tool_choice": "required"}), "tools", limit),
            (f"chat-tool-auto-{name}", "/v1/chat/completions",
             _chat({"tools": [_tool(schema)], "tool_choice": "auto"}), "tools", limit),
            (f"responses-tool-required-{name}", "/v1/responses",
             _response({"tools": [{"type": "function", "name": "bomb", "parameters": schema}],
                        "tool_choice": "required"}), "tools", limit),
        ]
    for name, (grammar, limit) in GRAMMARS.items():
        cases += [
            (f"completion-guided_grammar-{name}", "/v1/completions",
             _completion({"guided_grammar": grammar}), "guided_grammar", limit),
            (f"chat-structured_outputs-{name}", "/v1/chat/completions",
             _chat({"structured_outputs": {"grammar": grammar}}), "structured_outputs", limit),
        ]
    for name, (choices, limit) in CHOICE_LISTS.items():
        cases += [
            (f"completion-guided_choice-{name}", "/v1/completions",
             _completion({"guided_choice": choices}), "guided_choice", limit),
            (f"chat-structured_outputs-{name}", "/v1/chat/completions",
             _chat({"structured_outputs": {"choice": choices}}), "structured_outputs", limit),
        ]
    return cases


CASES = _cases()


@pytest.mark.parametrize("route,body,param,limit", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_bomb_is_a_400_naming_the_field_and_the_limit(server, client, route, body, param,
                                                        limit):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and limit in error["message"], error
    assert server.proc.poll() is None


def test_the_server_is_alive_and_serves_honest_constraints_after_the_bombs(server, client):
    """Runs after every bomb above (same module, same server)."""
    assert server.proc.poll() is None
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json=_completion({"guided_choice": CHOICES,
                                                         "max_tokens": 20, "seed": 1,
                                                         "temperature": 1.0}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in CHOICES
    r = client.post("/v1/chat/completions", json=_chat({
        "max_tokens": 300, "seed": 2, "temperature": 1.0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "weather", "schema": WEATHER}}}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        valid_json(choice["message"]["content"], WEATHER)
    r = client.post("/v1/chat/completions", json=_chat({
        "max_tokens": 64, "tools": [_tool(bombs.agent_schema())], "tool_choice": "required"}))
    assert r.status_code == 200, r.text          # a realistic agent schema is served
    assert "crashed" not in server.log() and "Segmentation" not in server.log()
    assert server.proc.poll() is None
