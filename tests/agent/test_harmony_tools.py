"""Function calling in harmony, below HTTP: what kvrelay renders for chat requests with tools,
calls and tool results (token-equal to openai-harmony's own rendering), and how scripted
model output becomes OpenAI objects (non-streamed messages, streamed chunks, Responses
items and events), checked against the openai package's own pydantic types."""
from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)
from pydantic import TypeAdapter

from kvrelay.harmony import get_encoding
from kvrelay.server.chat import finish_reason
from kvrelay.server.harmony_chat import HarmonyChat
from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError
from kvrelay.server.response_output import Decoder, OutputBuilder
from kvrelay.server.response_request import input_messages
from kvrelay.server.tools import tool_spec
from tests.harmony_factories import scripted_harmony_answer, scripted_tool_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "a city"},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]


@pytest.fixture(scope="module")
def enc():
    return get_encoding()


@pytest.fixture(scope="module")
def chat():
    return HarmonyChat(tokenizer=None)  # type: ignore[arg-type]   # rendering needs no tokenizer


def _system(effort: ReasoningEffort | None = None) -> Message:
    content = SystemContent.new()
    if effort is not None:
        content = content.with_reasoning_effort(effort)
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(instructions: str | None = None, tools: bool = True) -> Message:
    dev = DeveloperContent.new()
    if instructions is not None:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools([ToolDescription.new("get_weather", "Weather now", WEATHER),
                                       ToolDescription.new("get_time", "", TIME)])
    return Message.from_role_and_content(Role.DEVELOPER, dev)


def _user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def _call(name: str, args: str) -> Message:
    return (Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
            .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))


def _result(name: str, text: str) -> Message:
    return (Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), text)
            .with_recipient("assistant").with_channel("commentary"))


def _analysis(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis")


def _final(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final")


def _harmony_ids(enc, *messages: Message) -> list[int]:
    return list(enc.render_conversation_for_completion(Conversation.from_messages(list(messages)),
                                                       Role.ASSISTANT))


def _calls(*calls: tuple[str, str, str]) -> list[dict]:
    return [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
            for cid, n, a in calls]


# each case: the chat request's fields, and the harmony messages openai-harmony renders
CASES = {
    "tools only": (
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
        lambda: [_system(), _developer(), _user("Weather in Paris?")]),
    "tools with system prompt and effort": (
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Weather?"}],
         "tools": TOOLS, "reasoning_effort": "high"},
        lambda: [_system(ReasoningEffort.HIGH), _developer("Be brief."), _user("Weather?")]),
    "call then result": (
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "reasoning": "Need the tool.",
                       "tool_calls": _calls(("call_a", "get_weather", '{"city":"Paris"}'))},
                      {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 21}'}],
         "tools": TOOLS, "tool_choice": "auto"},
        lambda: [_system(), _developer(), _user("Weather in Paris?"), _analysis("Need the tool."),
                 _call("get_weather", '{"city":"Paris"}'), _result("get_weather", '{"temp": 21}')]),
    "two calls, two results, then an answered turn and a new question": (
        {"messages": [{"role": "user", "content": "Weather and time?"},
                      {"role": "assistant", "content": "", "tool_calls": _calls(
                          ("c1", "get_weather", '{"city":"Oslo"}'), ("c2", "get_time", "{}"))},
                      {"role": "tool", "tool_call_id": "c1", "content": "cold"},
                      {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text",
                                                                          "text": "noon"}]},
                      {"role": "assistant", "content": "Cold at noon.", "reasoning": "Both in."},
                      {"role": "user", "content": "Thanks"}],
         "tools": TOOLS, "reasoning_effort": "low"},
        # the analysis of the answered turn is dropped (harmony's rule)
        lambda: [_system(ReasoningEffort.LOW), _developer(), _user("Weather and time?"),
                 _call("get_weather", '{"city":"Oslo"}'), _call("get_time", "{}"),
                 _result("get_weather", "cold"), _result("get_time", "noon"),
                 _final("Cold at noon."), _user("Thanks")]),
    "tool_choice none leaves the tools out": (
        {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "tool_choice": "none"},
        lambda: [_system(), _user("Hi")]),
    "named tool_choice": (
        {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
         "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        lambda: [_system(), _developer(), _user("Hi")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chat_request_renders_as_openai_harmony(enc, chat, case):
    fields, messages = CASES[case]
    rendered = chat.render(ChatCompletionRequest.model_validate(fields))
    assert rendered.prompt_ids == _harmony_ids(enc, *messages())
    assert sorted(rendered.stop_token_ids) == [200002, 200012]


def test_tools_in_the_developer_message_as_typescript(enc, chat):
    fields, _ = CASES["tools only"]
    text = enc.decode(chat.render(ChatCompletionRequest.model_validate(fields)).prompt_ids)
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text


def test_responses_items_render_like_the_equal_chat(enc, chat):
    """Responses input items (message, reasoning, function_call, function_call_output) give
    the same prompt as the chat request that says the same."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
             {"type": "function_call", "call_id": "call_a", "name": "get_weather",
              "arguments": '{"city":"Paris"}', "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_a", "output": '{"temp": 21}'}]
    body = ChatCompletionRequest.model_validate({"messages": input_messages(items),
                                                 "tools": TOOLS})
    _, messages = CASES["call then result"]
    assert chat.render(body).prompt_ids == _harmony_ids(enc, *messages())


@pytest.mark.parametrize("items, match", [
    ([{"type": "file_search_call", "id": "x"}], r"input\[0\]: unsupported input item type"),
    ([{"type": "builtin_call", "id": "x"}], r"input\[0\]: unsupported input item type"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     r"input\[0\]\.content\[0\]: unsupported content part type 'input_image'"),
    ([{"role": "robot", "content": "x"}], r"input\[0\]\.role"),
    ([{"type": "function_call", "name": "f"}], r"needs 'name' and 'call_id'"),
    ([{"type": "function_call_output", "output": "x"}], r"call_id"),
])
def test_unsupported_input_items(items, match):
    with pytest.raises(OpenAIError, match=match) as e:
        input_messages(items)
    assert e.value.status == 400


# ------------------------------------------------------------------ parsing scripted output


def _tokens(enc, text: str) -> list[int]:
    return enc.encode(text, allowed_special="all")


def _scripts(enc) -> dict[str, tuple[list[int], list[tuple[str, str]], str, str]]:
    """name → (completion tokens, expected calls, expected reasoning, expected content)"""
    call = scripted_tool_call("get_weather", '{"city": "Paris"}')
    after_analysis = scripted_tool_call("get_weather", '{"city":"Oslo"}', reasoning="Check.")
    several = (scripted_tool_call("get_weather", '{"city":"Rome"}', reasoning="Two.")[:-1]
               + _tokens(enc, "<|end|><|start|>assistant<|channel|>commentary to=functions.get_time"
                              " <|constrain|>json<|message|>{\"tz\":\"CET\"}<|call|>"))
    text_then_call = (_tokens(enc, "<|channel|>commentary<|message|>Let me look.<|end|>"
                                   "<|start|>assistant")
                      + scripted_tool_call("get_time", "{}"))
    return {
        "call": (call, [("get_weather", '{"city": "Paris"}')], "", ""),
        "call after analysis": (after_analysis, [("get_weather", '{"city":"Oslo"}')], "Check.", ""),
        "several calls": (several, [("get_weather", '{"city":"Rome"}'),
                                    ("get_time", '{"tz":"CET"}')], "Two.", ""),
        # a preamble (commentary without a recipient) is text for the user: content
        "text then call": (text_then_call, [("get_time", "{}")], "", "Let me look."),
    }


@pytest.mark.parametrize("name", ["call", "call after analysis", "several calls",
                                  "text then call"])
def test_scripted_calls_become_openai_tool_calls(enc, chat, name):
    tokens, calls, reasoning, content = _scripts(enc)[name]
    tools = tool_spec(TOOLS, "auto")
    parsed = chat.parse(tokens, "", tools)
    message = ChatCompletionMessage.model_validate(parsed.message())
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == len(calls)
    assert message.content == (content or None)
    assert (message.model_extra or {}).get("reasoning") == (reasoning or None)
    assert finish_reason("stop", bool(parsed.tool_calls)) == "tool_calls"

    # streamed: one chunk per delta, token by token, as the openai client accumulates them
    stream = chat.stream_parser(tools)
    deltas = [d for t in tokens for d in stream.feed([t], "")] + stream.flush()
    merged: dict[int, dict] = {}
    for d in deltas:
        chunk = ChatCompletionChunk.model_validate({
            "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": None}]})
        for tc in chunk.choices[0].delta.tool_calls or []:
            slot = merged.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "a call is named once"
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
    assert [(m["name"], m["arguments"]) for _, m in sorted(merged.items())] == calls
    assert all(m["id"].startswith("call_") for m in merged.values())
    assert stream.made_calls
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content


def test_tool_choice_none_returns_no_calls(enc, chat):
    tokens, *_ = _scripts(enc)["call"]
    tools = tool_spec(TOOLS, "none")
    assert chat.parse(tokens, "", tools).tool_calls == []
    stream = chat.stream_parser(tools)
    assert not any("tool_calls" in d for t in tokens for d in stream.feed([t], ""))
    assert not stream.made_calls


def test_plain_answer_has_no_tool_calls(chat):
    parsed = chat.parse(scripted_harmony_answer("Think.", "Hello."), "", tool_spec(TOOLS, None))
    message = parsed.message()
    assert message["content"] == "Hello." and "tool_calls" not in message
    assert finish_reason("stop", False) == "stop" and finish_reason("length", True) == "length"


@pytest.mark.parametrize("name", ["call", "call after analysis", "several calls",
                                  "text then call"])
def test_scripted_calls_become_response_items_and_events(enc, name):
    from openai.types.responses import ResponseOutputItem, ResponseStreamEvent
    tokens, calls, reasoning, _ = _scripts(enc)[name]
    decoder = Decoder(True, OutputBuilder(tool_spec(TOOLS, None)))
    events = []
    for t in tokens:
        decoder.feed([t], "")
        events += decoder.builder.take_events()
    decoder.close()
    items = decoder.builder.finish(False)
    events += decoder.builder.take_events()
    items = [TypeAdapter(ResponseOutputItem).validate_python(i) for i in items]
    got = [(i.name, i.arguments) for i in items if i.type == "function_call"]
    assert got == calls
    assert all(i.call_id.startswith("call_") for i in items if i.type == "function_call")
    texts = [c.text for i in items if i.type == "reasoning" for c in i.content]
    assert "".join(texts) == reasoning
    assert decoder.reasoning_tokens == len(enc.encode(reasoning))    # usage's reasoning_tokens
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python({**e, "sequence_number": n}) for n, e in enumerate(events)]
    kinds = [e.type for e in parsed]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    assert kinds.count("response.function_call_arguments.done") == len(calls)
    args = {}
    for e in parsed:
        if e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    assert sorted(args.values()) == sorted(a for _, a in calls)
    # every item's events come between its added and done events, in output order
    order = [e.output_index for e in parsed if e.type == "response.output_item.added"]
    assert order == list(range(len(items)))
    assert json.dumps(events)       # plain JSON
