"""A harmony parser that never 500s (issue 29, item 5): hypothesis drives random and
adversarial completion tokens — unexpected special tokens mid-message, garbage headers,
channels that never end, `to=` with no call, `<|call|>` without a recipient, an early
`<|return|>`, tokens after the end, `<|constrain|>` anywhere — through the real app's
/v1/chat/completions and /v1/responses, streamed and not, with and without tools
(a fuzz engine emits the given token ids; tests/agent/fakes.py has the app helpers).

Every answer must be a 200 with well-formed JSON / SSE that the openai client's types
accept, a finish reason (chat) or a final status (Responses) that says what happened, at
most one call under `parallel_tool_calls: false`, and the same message whichever way it
was asked for: a stream's deltas add up to the non-streamed answer, and Responses' items
hold the text of chat's message.

Each test runs FUZZ_EXAMPLES examples (a few seconds; derandomized, so CI runs the same
ones). For a longer, random run: KVRELAY_HARMONY_FUZZ_EXAMPLES=5000 python -m pytest
tests/agent/test_harmony_fuzz.py
"""
from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.harmony import FIRST_SPECIAL_ID, get_encoding
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.api import ServerState, build_app
from kvrelay.server.harmony_chat import HarmonyChat
from kvrelay.server.tools import AgentOptions

LONG_RUN = "KVRELAY_HARMONY_FUZZ_EXAMPLES" in os.environ
FUZZ_EXAMPLES = int(os.environ.get("KVRELAY_HARMONY_FUZZ_EXAMPLES", "60"))
VOCAB = 201088                       # gpt-oss's embedding rows: every id the engine can sample
MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time",
                                                "parameters": {"type": "object"}}}]
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

enc = get_encoding()
EVENTS = TypeAdapter(ResponseStreamEvent)


def _ids(text: str) -> list[int]:
    return enc.encode(text, allowed_special="all")


def _decode(ids: list[int]) -> str:
    return enc.decode([i for i in ids if 0 <= i < FIRST_SPECIAL_ID])


# pieces of harmony, well-formed and not, that random sequences are built from
PIECES = [_ids(t) for t in (
    "<|channel|>analysis<|message|>", "<|channel|>final<|message|>",
    "<|channel|>commentary<|message|>",
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    "<|channel|>commentary to=functions.get_time<|message|>",
    "<|channel|>analysis to=functions.get_weather<|message|>",
    "<|channel|>commentary to=functions.unknown_fn <|constrain|>json<|message|>",
    "<|channel|>commentary to=<|message|>", "<|channel|>commentary to=functions. <|message|>",
    " to=functions.", "<|channel|>commentary to=functions.a b c<|message|>",
    "<|channel|>analysis to=python code<|message|>", "<|channel|>final garbage header<|message|>",
    "<|channel|>xyz<|message|>", "<|end|><|start|>assistant", "<|end|>", "<|start|>",
    "<|start|>user<|message|>", "<|start|>assistant<|channel|>", "<|call|>", "<|return|>",
    "<|constrain|>", "<|constrain|>json", "<|message|>", "<|channel|>",
    '{"city": "Paris"}', '{"city": "Pa', "Hello wörld 😀 日本語 𓀀", "Let me think.", "\n\n",
)]


def _flatten(parts: list[list[int]]) -> list[int]:
    return [t for part in parts for t in part]


tokens_st = st.lists(st.one_of(
    st.sampled_from(PIECES),
    st.text(max_size=12).map(lambda t: enc.encode(t)),                # any unicode, split
    st.integers(FIRST_SPECIAL_ID, VOCAB - 1).map(lambda t: [t]),     # any special / reserved
    st.integers(0, FIRST_SPECIAL_ID - 1).map(lambda t: [t]),         # any text token
), min_size=1, max_size=24).map(_flatten).filter(bool)


@dataclass
class Case:
    tokens: list[int]
    chunk: int                  # tokens per engine step (1: one a step; more: async / spec)
    honour_stops: bool          # False: tokens go on after <|return|> / <|call|>
    end_reason: str             # how the engine ends a script it was not stopped in
    tools: str                  # "no tools" | "auto" | "none" | "required" | "named"
    parallel: bool | None       # parallel_tool_calls
    max_tokens: int | None
    include_usage: bool


cases = st.builds(
    Case, tokens=tokens_st, chunk=st.integers(1, 4), honour_stops=st.booleans(),
    end_reason=st.sampled_from(["length", "stop"]),
    tools=st.sampled_from(["no tools", "auto", "none", "required", "named"]),
    parallel=st.sampled_from([None, True, False]),
    max_tokens=st.one_of(st.none(), st.integers(1, 40)), include_usage=st.booleans())


@dataclass
class FuzzEngine:
    """Emits `case.tokens` as given, `case.chunk` a step, ending at a stop token of the
    request ("stop") when `case.honour_stops`, else at the end of the script
    (`case.end_reason`) or at max_tokens ("length"). `planned` is how it would end."""
    case: Case | None = None
    planned: str = ""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dead: str | None = None
    info: dict[str, Any] = field(default_factory=lambda: {"max_model_len": 8192})

    def __post_init__(self) -> None:
        self.ready.set()

    def plan(self, params: SamplingParams) -> tuple[list[int], str]:
        assert self.case is not None
        script, limit = self.case.tokens, params.max_tokens or len(self.case.tokens)
        tokens, reason = script[:limit], (self.case.end_reason if limit >= len(script)
                                          else "length")
        stops = set(params.stop_token_ids or [])
        if self.case.honour_stops:
            for i, t in enumerate(tokens):
                if t in stops:
                    return tokens[:i + 1], "stop"
        return tokens, reason

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        assert self.case is not None
        tokens, self.planned = self.plan(params)
        stops = set(params.stop_token_ids or [])
        sent: list[int] = []
        for start in range(0, len(tokens), self.case.chunk):
            delta = tokens[start:start + self.case.chunk]
            sent += delta
            last = len(sent) == len(tokens)
            reason = self.planned if last else None
            stop_reason = delta[-1] if last and delta[-1] in stops and reason == "stop" else None
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(
                0, _decode(sent), list(sent), reason, stop_reason, delta_text=_decode(delta),
                delta_token_ids=list(delta))], finished=last)
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def app():
    from starlette.testclient import TestClient
    engine = FuzzEngine()
    state = ServerState(engine=engine, tokenizer=None, served_names=[MODEL],  # type: ignore[arg-type]
                        max_model_len=8192, max_logprobs=5, chat=HarmonyChat(None),
                        agent=AgentOptions())          # a plain `kvrelay serve`: no tool flags
    with TestClient(build_app(state), base_url="http://testserver") as http:
        yield engine, http


# ------------------------------------------------------------------ requests


def _tool_fields(case: Case, api: str) -> dict[str, Any]:
    if case.tools == "no tools":
        return {}
    body: dict[str, Any] = {"tools": CHAT_TOOLS if api == "chat" else RESPONSE_TOOLS}
    if case.tools == "named":
        body["tool_choice"] = ({"type": "function", "function": {"name": "get_weather"}}
                               if api == "chat" else {"type": "function", "name": "get_weather"})
    else:
        body["tool_choice"] = case.tools
    if case.parallel is not None:
        body["parallel_tool_calls"] = case.parallel
    return body


def _post(http, path: str, body: dict[str, Any]):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r


def _sse_data(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking its framing."""
    assert text.endswith("\n\n"), text[-200:]
    payloads = []
    for event in text[:-2].split("\n\n"):
        lines = event.split("\n")
        assert lines[-1].startswith("data: "), event
        payloads.append(lines[-1][len("data: "):])
    return payloads


# ------------------------------------------------------------------ chat


@dataclass
class ChatAnswer:
    content: str
    reasoning: str
    calls: list[tuple[str, str]]
    finish: str
    usage: dict[str, Any] | None


def _chat(http, case: Case, stream: bool) -> ChatAnswer:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "temperature": 1.0, **_tool_fields(case, "chat")}
    if case.max_tokens is not None:
        body["max_tokens"] = case.max_tokens
    if not stream:
        out = ChatCompletion.model_validate(_post(http, "/v1/chat/completions", body).json())
        (choice,) = out.choices
        message = choice.message
        extra = message.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        assert choice.finish_reason is not None
        return ChatAnswer(message.content or "", extra.get("reasoning") or "",
                          [(c.function.name, c.function.arguments)
                           for c in message.tool_calls or []], choice.finish_reason,
                          out.usage.model_dump() if out.usage else None)
    body["stream"] = True
    if case.include_usage:
        body["stream_options"] = {"include_usage": True}
    payloads = _sse_data(_post(http, "/v1/chat/completions", body).text)
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    usage = None
    if case.include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        usage = chunks.pop().usage.model_dump()
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] is not None and all(f is None for f in finishes[:-1]), finishes
    content, reasoning, calls = [], [], {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        content.append(delta.content or "")
        reasoning.append(extra.get("reasoning") or "")
        for tc in delta.tool_calls or []:
            if tc.id is not None:                  # the first delta of a call names it
                assert tc.index not in calls and tc.function and tc.function.name
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += (tc.function.arguments or "") if tc.function else ""
    assert sorted(calls) == list(range(len(calls)))
    return ChatAnswer("".join(content), "".join(reasoning),
                      [(n, a) for _, (n, a) in sorted(calls.items())], finishes[-1], usage)


def _check_chat(case: Case, answer: ChatAnswer, planned: str) -> None:
    assert answer.finish in ("stop", "length", "tool_calls")
    if answer.finish == "length":
        assert planned == "length"
    else:
        assert (answer.finish == "tool_calls") == bool(answer.calls)
        if planned == "length":        # only a turn ended after its one call stops early
            assert case.parallel is False and len(answer.calls) == 1, answer
    if case.tools in ("no tools", "none"):
        assert answer.calls == []
    if case.parallel is False:
        assert len(answer.calls) <= 1
    assert all(name and set(name) <= NAME_CHARS for name, _ in answer.calls)


CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def _case(text: str, tools: str = "auto", parallel: bool | None = None,
          max_tokens: int | None = None, honour_stops: bool = True) -> Case:
    return Case(_ids(text), 1, honour_stops, "length", tools, parallel, max_tokens, True)


# the shapes the random search found (or that broke earlier versions), always run
EXAMPLES = [
    _case(CALL + '{"city": "Pa', max_tokens=12),                 # a call cut by max_tokens
    _case("<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>"
          "Hi<|return|>"),                                        # no <|end|> before <|start|>
    _case("<|channel|>analysis<|message|>think<|channel|>final<|message|>Hi<|return|>"),
    _case(CALL + '{"city": "Oslo"}<|end|><|start|>assistant' + CALL + '{"city": "Rome"}<|call|>',
          parallel=False),                                        # a second call: cut
    _case(CALL + '{"city": "Oslo"}<|end|><|start|>assistant' + CALL + '{"city": "Rome"}<|call|>',
          parallel=True),
    _case(CALL + "<|channel|>analysis<|message|>x", parallel=False),  # a call with no text
    _case("<|channel|>commentary to=functions.<|message|>{}<|call|>"),    # no function name
    _case("<|channel|>commentary to=<|message|>{}<|call|>"),              # no recipient
    _case("<|channel|>xyz<|message|>odd channel<|return|>"),
    _case(CALL + '{"city": "Oslo"}<|call|>', tools="none"),      # a call it may not make
    _case("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant" + CALL
          + "{}<|call|>"),                                        # a preamble, then a call
    _case("<|channel|>final<|message|>a<|constrain|>b<|message|>c<|endoftext|>d<|return|>"),
    _case("<|channel|>final<|message|>Hi<|return|> and more<|return|>", honour_stops=False),
    _case("<|return|>"), _case("<|call|>"), _case("<|constrain|>"),
    _case("Just text, no harmony at all.", tools="no tools"),
]


def _examples(test):
    for case in EXAMPLES:
        test = example(case=case)(test)
    return test


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=not LONG_RUN, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases)
@_examples
def test_chat_never_fails_and_streams_add_up(app, case):
    engine, http = app
    engine.case = case
    whole = _chat(http, case, stream=False)
    planned = engine.planned
    _check_chat(case, whole, planned)
    streamed = _chat(http, case, stream=True)
    assert (streamed.content, streamed.reasoning, streamed.calls, streamed.finish) == (
        whole.content, whole.reasoning, whole.calls, whole.finish)
    assert streamed.usage in (None, whole.usage)
    # output without any harmony structure is all content
    emitted = engine.plan(SamplingParams(max_tokens=case.max_tokens))[0]
    if all(t < FIRST_SPECIAL_ID for t in case.tokens) and case.tools in ("no tools", "none"):
        assert whole.content == _decode(emitted) and whole.finish in ("stop", "length")


# ------------------------------------------------------------------ responses


def _items(output: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Output items without their ids: (type, text) or (type, name, arguments)."""
    out: list[tuple[str, ...]] = []
    for item in output:
        if item["type"] == "function_call":
            out.append(("function_call", item["name"], item["arguments"]))
        else:
            text = "".join(p["text"] for p in item["content"])
            out.append((item["type"], text))
    return out


def _responses(http, case: Case, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"input": "Weather in Paris?", "temperature": 1.0,
                            **_tool_fields(case, "responses")}
    if case.max_tokens is not None:
        body["max_output_tokens"] = case.max_tokens
    if not stream:
        response = _post(http, "/v1/responses", body).json()
        Response.model_validate(response)
        return response
    body["stream"] = True
    events = [json.loads(p) for p in _sse_data(_post(http, "/v1/responses", body).text)]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    response = events[-1]["response"]
    # each item: added, its deltas, done — and the deltas add up to what done says
    deltas: dict[str, str] = {}
    open_items: set[int] = set()
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            open_items.add(e["output_index"])
        elif e["type"] == "response.output_item.done":
            open_items.remove(e["output_index"])
            assert e["item"] == response["output"][e["output_index"]]
        elif e["type"].endswith(".delta"):
            assert e["output_index"] in open_items
            deltas[e["item_id"]] = deltas.get(e["item_id"], "") + e["delta"]
        elif e["type"] in ("response.output_text.done", "response.reasoning_text.done"):
            assert deltas.pop(e["item_id"], "") == e["text"]
        elif e["type"] == "response.function_call_arguments.done":
            assert deltas.pop(e["item_id"], "") == e["arguments"]
    assert not open_items and not deltas
    return response


def _check_response(case: Case, response: dict[str, Any], planned: str) -> None:
    status = response["status"]
    assert status in ("completed", "incomplete")
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    if status == "incomplete":
        assert planned == "length" and response["incomplete_details"] == {
            "reason": "max_output_tokens"}
    elif planned == "length":            # only a turn ended after its one call stops early
        assert case.parallel is False and len(calls) == 1
    # every item is closed: the last one cut short when the response is
    statuses = [i["status"] for i in response["output"]]
    assert statuses == ["completed"] * (len(statuses) - 1) + [status] if statuses else True
    if case.tools in ("no tools", "none") or case.parallel is False:
        assert len(calls) <= (0 if case.tools in ("no tools", "none") else 1)
    assert response["usage"]["output_tokens"] >= 1


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=not LONG_RUN, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases)
@_examples
def test_responses_never_fail_and_agree_with_chat(app, case):
    engine, http = app
    engine.case = case
    whole = _responses(http, case, stream=False)
    _check_response(case, whole, engine.planned)
    streamed = _responses(http, case, stream=True)
    assert _items(streamed["output"]) == _items(whole["output"])
    assert (streamed["status"], streamed["usage"]) == (whole["status"], whole["usage"])
    # the same tokens on chat: its message holds the same text and calls
    chat = _chat(http, case, stream=False)
    items = _items(whole["output"])
    assert "".join(t for kind, *rest in items if kind == "message" for t in rest) == chat.content
    assert "".join(t for kind, *rest in items if kind == "reasoning"
                   for t in rest) == chat.reasoning
    assert [tuple(rest) for kind, *rest in items if kind == "function_call"] == chat.calls
