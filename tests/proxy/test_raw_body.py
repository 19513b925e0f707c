"""The proxy's large-body path (`kvrelay.proxy.body`, `rawjson`): a body split into raw
fields gives the same prompt key, the same refusals and the same forwarded bodies as the
same body parsed whole — and never builds the body in memory.

The size thresholds are lowered (`small_thresholds`) so that bodies of a few hundred bytes
take the raw paths: every field, element and string is then walked as a large one is."""
from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from kvrelay import rawjson
from kvrelay.http_body import BodyError, parse_object
from kvrelay.proxy import body as body_mod
from kvrelay.proxy import responses
from kvrelay.proxy.body import parse_body
from kvrelay.proxy.prefix import Hasher, render
from kvrelay.proxy.routing import decode_body, prefill_body, prefill_edit

pytestmark = pytest.mark.unit

H = Hasher(block_size=4, chars_per_token=2.0)        # text chunks of 8 characters


@pytest.fixture
def small_thresholds(monkeypatch):
    monkeypatch.setattr(body_mod, "INLINE_PARSE_BYTES", 0)
    monkeypatch.setattr(body_mod, "FIELD_PARSE_BYTES", 24)
    monkeypatch.setattr(body_mod, "ARRAY_BATCH_BYTES", 40)
    monkeypatch.setattr(rawjson, "ELEMENT_PARSE_BYTES", 12)
    monkeypatch.setattr(rawjson, "STRING_WINDOW_BYTES", 5)


def _keys(path: str, body: dict, raw: bytes | None = None):
    """The key of `body` parsed whole, and of its raw split (which must be all raw)."""
    whole = H.key(path, responses.key_body(body) if path == responses.PATH else body)
    split = parse_body(raw if raw is not None else json.dumps(body).encode())
    fields = split.fields
    raw_key = H.key(path, responses.key_body(fields) if path == responses.PATH else fields,
                    split.prompt_bytes)
    return whole, raw_key, split


TEXT = "Héllo, wörld! \"quoted\" \\ back\nslash \U0001F600 emoji \u2028 tab\t" * 3

BODIES = [
    ("/v1/completions", {"model": "m", "prompt": TEXT, "max_tokens": 3}),
    ("/v1/completions", {"model": "m", "prompt": list(range(1000, 1100))}),
    ("/v1/completions", {"model": "m", "prompt": [list(range(7, 40)), [], list(range(9))]}),
    ("/v1/completions", {"model": "m", "prompt": [TEXT, "second prompt", TEXT]}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2 ** 70, 3] * 8}),
    ("/v1/completions", {"model": "m", "prompt": [[1, 2], "not ids"] * 5}),
    ("/v1/completions", {"model": "m", "prompt": {"odd": [TEXT, 1.5, None, True]}}),
    ("/v1/chat/completions", {
        "model": "m",
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": TEXT,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        "messages": [
            {"role": "system", "content": TEXT},
            {"content": [{"type": "text", "text": TEXT}, {"type": "text", "text": "two"}],
             "role": "user"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": TEXT}}]},
            "a bare string", 7, None]}),
    (responses.PATH, {"model": "m", "instructions": TEXT, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": TEXT}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": TEXT}]}),
    (responses.PATH, {"model": "m", "input": TEXT * 2}),
]


@pytest.mark.parametrize("path, body", BODIES, ids=range(len(BODIES)))
def test_a_raw_body_keys_as_the_parsed_body(small_thresholds, path, body):
    whole, raw_key, split = _keys(path, body)
    assert any(isinstance(v, rawjson.RawJSON) for v in split.fields.values())
    assert raw_key == whole


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_a_raw_string_is_read_window_by_window_whatever_its_escapes(small_thresholds,
                                                                   ensure_ascii):
    """Windows of 5 bytes never split a UTF-8 sequence, an escape or a surrogate pair."""
    value = rawjson.node(json.dumps(TEXT, ensure_ascii=ensure_ascii).encode())
    assert isinstance(value, rawjson.RawJSON)
    windows = list(rawjson.string_windows(value))
    assert "".join(windows) == TEXT and len(windows) > 20


def test_random_bodies_key_alike(small_thresholds):
    """Random chats, in random JSON layouts (spaces, escapes), key the same both ways."""
    rng = random.Random(7)
    alphabet = "ab \"\\\n\u00e9\u4e2d\U0001F600{}[],:0123"
    for _ in range(60):
        def text() -> str:
            return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        messages = [{"role": rng.choice(["user", "assistant", "system"]),
                     "content": rng.choice([text(), None,
                                            [{"type": "text", "text": text()}],
                                            {"x": [text(), rng.random()]}])}
                    for _ in range(rng.randint(1, 6))]
        body = {"model": "m", "messages": messages}
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5,
                         indent=rng.choice([None, 1])).encode()
        whole, raw_key, _ = _keys("/v1/chat/completions", body, raw)
        assert raw_key == whole, raw


def test_a_long_prompt_hashes_only_its_head_and_estimates_its_length(small_thresholds,
                                                                     monkeypatch):
    from kvrelay.proxy import prefix
    monkeypatch.setattr(prefix, "MAX_KEY_BLOCKS", 4)
    body = {"model": "m", "prompt": "y" * 1000}
    whole, raw_key, split = _keys("/v1/completions", body)
    assert raw_key.hashes == whole.hashes and len(whole.hashes) == 4
    assert whole.tokens == 500                               # parsed: counted
    assert raw_key.tokens == split.prompt_bytes // 2         # raw: from its bytes


def test_render_is_unchanged_for_parsed_bodies():
    body = BODIES[7][1]
    assert render(body).startswith("<|tools|>" + json.dumps(body["tools"], sort_keys=True))
    assert "<|user|>" + TEXT + "two<|end|>" in render(body)


# ------------------------------------------------------------------ forwarded bodies

def test_each_leg_gets_the_clients_bytes_with_its_fields_spliced_in(small_thresholds):
    raw = (b'{ "model" : "m",\n "prompt": [1,  2, 3], "stream": true, "stream_options": '
           b'{"include_usage": true}, "max_completion_tokens": 9, "kv_transfer_params": 5,'
           b' "extra": "\\u00e9"}')
    split = parse_body(raw)
    original = json.loads(raw)
    prefill = split.payload(*prefill_edit(split.fields))
    assert prefill.json() == prefill_body(original)
    assert b'"prompt":[1,  2, 3]' in b"".join(prefill.pieces)       # as the client wrote it
    kv = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    assert split.payload({"kv_transfer_params": kv}).json() == decode_body(original, kv)
    direct = split.payload({}, drop=("kv_transfer_params",))
    assert direct.json() == {k: v for k, v in original.items() if k != "kv_transfer_params"}
    assert direct.length == len(b"".join(direct.pieces))


def test_a_large_payload_goes_a_window_at_a_time(monkeypatch):
    import asyncio
    monkeypatch.setattr(body_mod, "SEND_WINDOW_BYTES", 1000)
    raw = json.dumps({"model": "m", "prompt": "z" * 5000}).encode()
    payload = parse_body(raw).payload({"max_tokens": 1})

    async def chunks() -> list[bytes]:
        content = payload.content()
        assert not isinstance(content, bytes)
        return [c async for c in content]
    parts = asyncio.run(chunks())
    assert max(map(len, parts)) <= 1000 and len(b"".join(parts)) == payload.length
    assert json.loads(b"".join(parts)) == {"model": "m", "prompt": "z" * 5000, "max_tokens": 1}


# ------------------------------------------------------------------ refusals

def _refusal(raw: bytes) -> tuple[str, str | None]:
    with pytest.raises(BodyError) as e:
        parse_body(raw)
    assert e.value.status == 400
    return e.value.message, e.value.param


BAD = [
    b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, ' + b"7" * 5001 + b"]}",
    b'{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}, '
    b'{"role": "user", "content": "z", "temperature": NaN}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, '
    b'{"type": "text", "text": "also fine", "n": 1e999}]}]}',
    b'{"prompt": "long enough to be raw \\ud800 lone"}',
    b'{"prompt": "long enough to be raw \xff\xfe bad utf-8"}',
    b'[{"prompt": "long enough to be raw, but not an object"}]',
    b'{"prompt": "long enough to be raw", "max_tokens": 1' + b"0" * 200 + b"}",
]


@pytest.mark.parametrize("raw", BAD, ids=range(len(BAD)))
def test_a_raw_body_is_refused_as_the_parsed_body_is(small_thresholds, monkeypatch, raw):
    message, param = _refusal(raw)
    monkeypatch.setattr(body_mod, "INLINE_PARSE_BYTES", 1 << 20)
    with pytest.raises(BodyError) as whole:
        parse_object(raw)
    if "surrogate" in whole.value.message or "UTF-8" in whole.value.message:
        assert ("surrogate" in message or "malformed" in message) or "UTF-8" in message
    else:
        assert (message, param) == (whole.value.message, whole.value.param)


def test_a_refused_element_is_named_by_its_place_in_the_whole_array(small_thresholds):
    ids = ", ".join(str(i) for i in range(300))
    raw = ('{"prompt": [' + ids + ", " + "9" * 150 + "]}").encode()
    message, param = _refusal(raw)
    assert param == "prompt.300" and message.startswith("prompt.300: an integer of 150 digits")


def test_elements_are_walked_whatever_their_layout(small_thresholds):
    values = [[1, [2, {"a": "]},[\\\"x"}], "y"], {"b": [None, True, -1.5e3]}, "s,t", 0, [],
              {}, "\u00e9" * 20, [[[[]]]]]
    for indent in (None, 0, 2):
        raw = json.dumps(values, indent=indent, ensure_ascii=indent is None).encode()
        array = rawjson.node(raw)
        assert isinstance(array, rawjson.RawJSON)
        assert [rawjson.parsed(e) for e in rawjson.elements(array)] == values
        assert [s for s, *_ in body_mod._array_pieces(array.buf)]     # batches found


# ------------------------------------------------------------------ memory

@pytest.mark.parametrize("prompt", [list(range(10 ** 5, 10 ** 5 + 600_000)), "w" * 4_000_000,
                                    [{"role": "user", "content": "hi there " * 20}] * 20_000])
def test_a_large_body_is_never_built(prompt):
    """Parsing 600,000 token ids would take ~6x their bytes (a Python int each); the proxy
    holds the bytes, bounded pieces and the key's hashes."""
    field = "messages" if isinstance(prompt[0], dict) else "prompt"
    raw = json.dumps({"model": "m", field: prompt, "max_tokens": 4}).encode()
    path = "/v1/chat/completions" if field == "messages" else "/v1/completions"
    tracemalloc.start()
    try:
        split = parse_body(raw)
        key = Hasher().key(path, split.fields, split.prompt_bytes)
        payload = split.payload(*prefill_edit(split.fields))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert key.hashes and payload.length > len(raw) - 100
    assert peak < 0.2 * len(raw), (peak, len(raw))     # windows of 64 KiB, the keys


def test_the_key_walks_a_bounded_number_of_pieces(small_thresholds, monkeypatch):
    """Six million `null` messages render as nothing: the walk stops after MAX_KEY_PIECES
    pieces (a message is at least one) and the length is estimated from the bytes."""
    from kvrelay.proxy import prefix
    monkeypatch.setattr(prefix, "MAX_KEY_PIECES", 50)
    walked = []
    real_node = rawjson.node
    monkeypatch.setattr(rawjson, "node", lambda buf: walked.append(1) or real_node(buf))
    split = parse_body(json.dumps({"model": "m", "messages": [None] * 5000}).encode())
    walked.clear()
    key = H.key("/v1/chat/completions", split.fields, split.prompt_bytes)
    assert len(walked) <= 52 and key.hashes == []
    assert key.tokens == split.prompt_bytes // 2
