"""Structured outputs through live servers and the openai client: response_format,
structured_outputs and guided_* on chat and completions; harmony's final answer under the
grammar while the analysis stays free; bad constraints are 400s with an OpenAI error body."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvrelay import harmony
from tests.processes import Server
from tests.structured.schemas import CHOICES, PERSON, REGEX, WEATHER, valid_json, valid_regex

SEEDS = range(6)


@pytest.fixture(scope="module")
def server(bytes_ckpt, tmp_path_factory):
    s = Server(str(bytes_ckpt), ["--dtype", "float32", "--max-model-len", "256",
                                 "--served-model-name", "tiny"],
               tmp_path_factory.mktemp("structured-server") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def harmony_server(harmony_ckpt, tmp_path_factory):
    s = Server(str(harmony_ckpt), ["--dtype", "float32", "--max-model-len", "512",
                                   "--served-model-name", "gpt-oss-tiny"],
               tmp_path_factory.mktemp("structured-harmony") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_chat_response_format_json_schema(server):
    client = _client(server)
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        out = client.chat.completions.create(model="tiny", seed=seed, temperature=1.0,
                                             max_tokens=120,
                                             messages=[{"role": "user", "content": "A person?"}],
                                             response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        valid_json(out.choices[0].message.content, PERSON)


def test_completions_vllm_fields(server):
    client = _client(server)
    for seed in SEEDS:
        for extra, check in [({"structured_outputs": {"regex": REGEX}}, valid_regex),
                             ({"guided_choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
                             ({"guided_json": WEATHER}, lambda t: valid_json(t, WEATHER)),
                             ({"response_format": {"type": "json_object"}},
                              lambda t: t.startswith("{"))]:
            out = client.completions.create(model="tiny", prompt="Answer:", seed=seed,
                                            temperature=1.0, max_tokens=120, extra_body=extra)
            check(out.choices[0].text)


def test_streamed_json_is_valid(server):
    client = _client(server)
    stream = client.chat.completions.create(
        model="tiny", seed=3, temperature=1.0, max_tokens=120, stream=True,
        messages=[{"role": "user", "content": "Weather?"}],
        extra_body={"structured_outputs": {"json": WEATHER}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    valid_json(text, WEATHER)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs", "unclosed"),
    ({"guided_regex": "(x"}, "guided_regex", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "nothing"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "only one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one of"),
])
def test_bad_constraints_are_400(server, extra, param, words):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
        assert error["param"].startswith(param) and words in error["message"], error


def test_harmony_final_answer_is_constrained_analysis_free(harmony_server):
    """The random model writes a free analysis message, then the final channel carries
    schema-valid JSON; openai's parse of the message sees content + reasoning."""
    client = _client(harmony_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    reasoned = 0
    for seed in range(8):
        out = client.chat.completions.create(
            model="gpt-oss-tiny", seed=seed, temperature=1.0, max_tokens=80,
            messages=[{"role": "user", "content": "Weather in Paris?"}], response_format=fmt)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and choice.stop_reason == harmony.RETURN_ID
        valid_json(choice.message.content, WEATHER)
        reasoned += bool((choice.message.model_extra or {}).get("reasoning"))
    assert reasoned > 0                          # the analysis channel stays open (and free)


def test_harmony_regex_with_small_budget(harmony_server):
    r = httpx.post(f"{harmony_server.url}/v1/chat/completions", timeout=120, json={
        "model": "gpt-oss-tiny", "seed": 1, "temperature": 1.0, "max_tokens": 10,
        "messages": [{"role": "user", "content": "Code?"}], "guided_regex": REGEX})
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["choices"][0]["finish_reason"] == "stop"          # budget 10 // 2 = 5 tokens
    valid_regex(body["choices"][0]["message"]["content"])
