"""Request preparation that a request's size cannot make costly (issue 26): the body's
shape bounded before the JSON parse and before pydantic (server/limits.py), prompt text
refused by its bytes or counted in pieces that stop at the context (server/prompt_tokens.py),
the preparation itself on worker threads (server/prep.py), typed kv_transfer_params that
the hold bucket and the engine read alike, and 503 + Retry-After until the engine is ready.
In process, over fake engines; the live-server checks are in test_heavy_requests_e2e.py."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server import prep, prompt_tokens
from kvrelay.server.admission import Admission, AdmissionLimits, AdmittedEngine
from kvrelay.server.api import ServerState, build_app
from kvrelay.server.chat import TemplateChat
from kvrelay.server.hold_limit import HoldRateLimiter
from kvrelay.server.limits import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_STRINGS,
    MAX_MESSAGES,
    MAX_TOOLS,
    RequestLimits,
    check_shape,
    scan_body,
)
from kvrelay.server.prompt_tokens import TokenizerFacts, encode_within, tokenizer_facts
from kvrelay.server.protocol import OpenAIError
from tests.agent.fakes import PLAIN_TEMPLATE, char_tokenizer
from tests.factories import add_word_tokenizer

LIMITS = RequestLimits(max_model_len=96, max_prompts=256)


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


# -- the body's shape, before the parse -------------------------------------------------------

def test_a_container_bomb_is_refused_before_the_parse():
    bomb = b'{"prompt": "w5", "x": [' + b"[]," * (MAX_JSON_CONTAINERS + 10) + b"[]]}"
    with pytest.raises(OpenAIError, match="arrays and objects"):
        scan_body(bomb, LIMITS)
    # brackets inside strings are text: a long code prompt is fine
    code = json.dumps({"prompt": "if (a[i]) { b[j] = \"}[\\\\\"; }\n" * 100_000}).encode()
    scan_body(code, LIMITS)


def test_metadata_its_bytes_prove_too_large_is_refused_before_the_parse(monkeypatch):
    """16 pairs of 64 + 512 characters, every one a 6-byte escape, is the most an acceptable
    `metadata` can take: past that the body is refused unparsed (a 25 MB metadata would be
    held twice, as text and as its value)."""
    from kvrelay.server import limits
    from kvrelay.server.response_store import check_metadata
    escaped = {f"\\u{k:04x}" * 63 + "k": "\\u00e9" * 512 for k in range(0x100, 0x110)}
    raw = ('{"model": "m", "input": "hi", "metadata": {'
           + ", ".join(f'"{k}": "{v}"' for k, v in escaped.items()) + "}}").encode()
    assert len(raw) > 50_000
    check_metadata(json.loads(raw)["metadata"])                  # acceptable ...
    limits.check_raw_fields("/v1/responses", raw, LIMITS)      # ... so not refused unparsed
    big = json.dumps({"model": "m", "input": "hi", "metadata": {"k": "v" * 1_000_000}}).encode()
    monkeypatch.setattr(prep.http_body, "decode", lambda raw: pytest.fail("parsed"))
    holder = prep.BodyHolder(big)
    with pytest.raises(OpenAIError, match=r"metadata\.k: values are at most 512 characters, "
                       r"got 1000000") as refused:
        prep.prepare_body(holder, "/v1/responses", object, LIMITS)    # type: ignore[arg-type]
    assert refused.value.param == "metadata.k"
    for bad, param in [({f"k{i}": "v" * 9000 for i in range(17)}, "metadata"),
                       ({"k" * 70_000: "v"}, "metadata"), ({"k": [1] * 30_000}, "metadata.k")]:
        with pytest.raises(OpenAIError) as whole:
            check_metadata(bad)
        with pytest.raises(OpenAIError) as unparsed:
            limits.check_raw_fields("/v1/responses", json.dumps({"metadata": bad}).encode(), LIMITS)
        assert (unparsed.value.message, unparsed.value.param) == \
            (whole.value.message, whole.value.param) and whole.value.param == param
    limits.check_raw_fields("/v1/chat/completions", big, LIMITS)         # Responses only


def test_too_many_strings_or_numbers_are_refused_before_the_parse():
    strings = json.dumps({"prompt": "w5", "stop": ["s"] * (MAX_JSON_STRINGS + 1)}).encode()
    with pytest.raises(OpenAIError, match="JSON strings"):
        scan_body(strings, LIMITS)
    assert LIMITS.max_numbers == 256 * 95 + 262_144
    ids = json.dumps({"prompt": [[7] * 95] * 4000}).encode()
    with pytest.raises(OpenAIError, match="numbers") as refused:
        scan_body(ids, LIMITS)
    assert refused.value.param == "prompt"
    digits = json.dumps({"prompt": "1, 2, 3, " * 200_000}).encode()   # digits in a string
    scan_body(digits, LIMITS)
    scan_body(json.dumps({"prompt": [[7] * 95] * 256}).encode(), LIMITS)   # the most allowed


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/completions", {"prompt": [[1, 2]] * 257}, "prompt", "257 prompts"),
    ("/v1/completions", {"prompt": [1] * 96}, "prompt", "maximum context length is 96"),
    ("/v1/completions", {"prompt": [[1, 2], [1] * 100]}, "prompt", "has 100 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)},
     "messages", f"at most {MAX_MESSAGES}"),
    ("/v1/chat/completions", {"messages": [], "tools": [{}] * (MAX_TOOLS + 1)}, "tools",
     f"at most {MAX_TOOLS}"),
    ("/v1/responses", {"input": [{}] * (MAX_MESSAGES + 1)}, "input", "input items"),
])
def test_shape_caps_name_the_field(path, body, param, words):
    with pytest.raises(OpenAIError, match=words) as refused:
        check_shape(path, body, LIMITS)
    assert refused.value.param == param


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_untokenised():
    limits = RequestLimits(96, 256, TokenizerFacts(longest_token_bytes=16))
    check_shape("/v1/completions", {"prompt": "x" * (95 * 16)}, limits)
    with pytest.raises(OpenAIError, match=r"at least 96 tokens \(1521 bytes") as refused:
        check_shape("/v1/completions", {"prompt": "x" * (95 * 16 + 1)}, limits)
    assert refused.value.param == "prompt"
    with pytest.raises(OpenAIError, match="at least"):
        check_shape("/v1/completions", {"prompt": ["w5", "é" * 800]}, limits)   # 1600 bytes


@pytest.mark.parametrize("text, refused_unparsed", [
    ("x" * 200_000, True),                    # plain ASCII: its bytes are its text
    ("x" * 100_000 + "\n" + "x" * 100_000, False),   # an escape: judged after the parse
    ("é" * 100_000, False),                   # non-ASCII: judged after the parse
    ("x" * 2000, False),                      # a short body: parsed at once
])
def test_a_plain_prompt_too_long_by_its_bytes_is_refused_before_the_parse(monkeypatch, text,
                                                                          refused_unparsed):
    """The same decision and message as `check_text_bytes` after the parse, from the raw
    bytes, for plain ASCII prompts (a 31 MB prompt is then held once, not twice)."""
    limits = RequestLimits(96, 256, TokenizerFacts(longest_token_bytes=16, untokenized="\x00y"))
    raw = json.dumps({"model": "m", "prompt": text + "y" * 7000}).encode()
    with pytest.raises(OpenAIError) as after_parse:
        check_shape("/v1/completions", json.loads(raw), limits)
    if not refused_unparsed:
        from kvrelay.server.limits import check_raw_fields
        check_raw_fields("/v1/completions", raw, limits)
        return
    monkeypatch.setattr(prep.http_body, "decode", lambda raw: pytest.fail("parsed"))
    with pytest.raises(OpenAIError) as before_parse:
        prep.prepare_body(prep.BodyHolder(raw), "/v1/completions", object, limits)  # type: ignore[arg-type]
    assert (before_parse.value.message, before_parse.value.param) == \
        (after_parse.value.message, after_parse.value.param)
    assert "(200000 bytes of text" in before_parse.value.message       # the y's not counted


# -- what a tokenizer guarantees ------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_bpe() -> CheckpointTokenizer:
    """A small byte-level BPE (the kind gpt-oss and the embedded model use)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. " * 20,
              "        indented code(x) -> y\n" * 20, "=" * 64 + " ---- " * 10,
              "日本語のテキスト。" * 5]
    tok.train_from_iterator(corpus, trainer)
    return CheckpointTokenizer(tok, (0,), PLAIN_TEMPLATE, {})


def test_byte_level_facts(byte_bpe):
    facts = tokenizer_facts(byte_bpe)
    longest = max(len(t) for t in byte_bpe.tokenizer.get_vocab(with_added_tokens=False))
    assert facts.longest_token_bytes == max(longest, len("<|end|>")) and facts.splittable
    assert facts.untokenized == "" and facts.kept == 1.0
    # every byte is in a token, none covers more than L bytes: ids >= bytes / L
    text = "hello world " * 50 + "=" * 300 + " 日本語 " * 20
    ids = prompt_tokens.encode(byte_bpe.tokenizer, text)
    assert len(ids) >= facts.min_tokens(facts.covered_bytes(text))


def test_word_tokenizers_have_no_bytes_bound_but_split_exactly(tmp_path):
    tok = CheckpointTokenizer(Tokenizer.from_file(str(add_word_tokenizer(tmp_path, 160)
                                                      / "tokenizer.json")), (0,), None, {})
    facts = tokenizer_facts(tok)
    assert facts.longest_token_bytes is None and facts.splittable    # an unknown word: 1 token
    assert tokenizer_facts(char_tokenizer()) == TokenizerFacts()     # not an HF tokenizer


@pytest.fixture()
def small_pieces(monkeypatch):
    """Pieces of ~1,000 characters, cut anywhere after 4,000: long text in a unit test."""
    monkeypatch.setattr(prompt_tokens, "CHUNK_CHARS", 1000)
    monkeypatch.setattr(prompt_tokens, "MAX_CHUNK_CHARS", 4000)
    encoded: list[int] = []
    real = prompt_tokens.encode
    monkeypatch.setattr(prompt_tokens, "encode",
                        lambda hf, text: encoded.append(len(text)) or real(hf, text))
    return encoded


def test_encoding_in_pieces_equals_the_whole(byte_bpe, small_pieces):
    facts = tokenizer_facts(byte_bpe)
    text = ("hello world, the quick brown fox.  Two  spaces\tand tabs\n\nnew lines 日本語 "
            * 400)
    whole = prompt_tokens.encode(byte_bpe.tokenizer, text)
    small_pieces.clear()
    assert encode_within(byte_bpe, facts, text, 10**9) == whole
    assert len(small_pieces) > 20 and max(small_pieces) < 4000     # it went in pieces
    run = "=" * 9000 + " hello"                     # no place to cut for 9,000 characters
    assert encode_within(byte_bpe, facts, run, 10**9) == prompt_tokens.encode(byte_bpe.tokenizer,
                                                                              run)


def test_counting_stops_at_the_context(byte_bpe, small_pieces):
    facts = tokenizer_facts(byte_bpe)
    text = "hello world, the quick brown fox. " * 30_000                   # ~1 MB
    with pytest.raises(OpenAIError, match="at least") as refused:
        encode_within(byte_bpe, facts, text, 500)
    assert refused.value.param == "prompt"
    assert sum(small_pieces) < 5000                  # a few pieces, not the megabyte
    small_pieces.clear()
    with pytest.raises(OpenAIError, match="about"):                   # cut anywhere
        encode_within(byte_bpe, facts, "x" * 100_000, 500)
    assert sum(small_pieces) < 20_000


def test_a_template_chat_is_refused_by_its_bytes_before_rendering(byte_bpe):
    chat = TemplateChat(byte_bpe)
    from kvrelay.server.protocol import ChatCompletionRequest
    longest = chat.facts.longest_token_bytes
    assert longest
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "system", "content": "a" * (longest * 50)},
                      {"role": "user", "content": "b" * (longest * 50)}]})
    with pytest.raises(OpenAIError, match="conversation has at least 100 tokens") as refused:
        chat.render(body, limit=100)
    assert refused.value.param == "messages"
    assert len(chat.render(body, limit=0).prompt_ids) >= 100          # no limit: rendered


# -- over HTTP: the route, the pool, the engine's readiness ----------------------------------

@dataclass
class FakeEngine:
    """Ready when told; answers every request with one token; a do_remote_decode request
    holds (records it), as a prefill's engine does."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dead: str | None = None
    info: Any = None
    held: list[str] = field(default_factory=list)
    sent: list[list[int]] = field(default_factory=list)

    async def generate(self, request_id: str, prompt: list[int], params: Any,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.sent.append(list(prompt))
        if kv_transfer_params and kv_transfer_params.get("do_remote_decode"):
            self.held.append(request_id)
        await asyncio.sleep(0)
        yield RequestOutput(request_id, None, list(prompt),
                            [CompletionOutput(0, "w5", [5], "length", delta_token_ids=[5])],
                            finished=True)

    async def free_remote(self, request_id: str, capability: str) -> bool:
        return False


def _state(engine: Any, max_model_len: int = 96, **kwargs: Any) -> ServerState:
    return ServerState(engine=engine, tokenizer=None, served_names=["m"],  # type: ignore[arg-type]
                       max_model_len=max_model_len, max_logprobs=5,
                       chat=TemplateChat(char_tokenizer(PLAIN_TEMPLATE)), **kwargs)


def test_every_v1_route_is_503_with_retry_after_until_the_engine_is_ready():
    engine = FakeEngine()
    state = _state(engine, max_model_len=0)            # as `kvrelay serve` starts
    client = TestClient(build_app(state))
    calls = [("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 1}),
             ("POST", "/v1/responses", {"input": "hi"}), ("GET", "/v1/models", None),
             ("GET", "/v1/responses/resp_1", None),
             ("POST", "/v1/kv_transfer/free", {"remote_request_id": "r",
                                               "remote_capability": "c"})]

    def statuses() -> list[int]:
        out = []
        for method, path, body in calls:
            r = client.request(method, path, json=body)
            if r.status_code == 503:
                error = _error(r, 503)
                assert error["type"] == "ServiceUnavailableError" and "retry after" in \
                    error["message"] and r.headers["Retry-After"] == "2"
            out.append(r.status_code)
        return out

    assert statuses() == [503] * len(calls) and client.get("/health").status_code == 503
    engine.ready.set()          # the engine is up, its model length not yet set: still 503
    assert statuses() == [503] * len(calls) and client.get("/health").status_code == 503
    state.max_model_len = 96
    assert statuses()[:4] == [200, 200, 200, 200] and client.get("/health").status_code == 200
    assert engine.sent, "requests reached the engine only once it was ready"
    state.accepting = False                            # draining
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
    assert "shutting down" in _error(r, 503)["message"]


def _prefill(limiter: HoldRateLimiter, queued: int = 64) -> tuple[TestClient, FakeEngine,
                                                                  AdmittedEngine]:
    core = FakeEngine()
    core.ready.set()
    engine = AdmittedEngine(core, Admission(AdmissionLimits(1, queued)))  # type: ignore[arg-type]
    state = _state(engine, hold_limiter=limiter)
    return TestClient(build_app(state), client=("10.0.0.21", 40000)), core, engine


@pytest.mark.parametrize("value", [1, "x", [1], None, 0, {"a": 1}])
@pytest.mark.parametrize("flag", ["do_remote_decode", "do_remote_prefill"])
def test_kv_transfer_flags_must_be_json_booleans(value, flag):
    client, core, _ = _prefill(HoldRateLimiter(rate=1, burst=100))
    for path, body in (("/v1/completions", {"prompt": [5, 6], "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1})):
        r = client.post(path, json=body | {"kv_transfer_params": {flag: value}})
        error = _error(r, 400)
        assert error["param"] == f"kv_transfer_params.{flag}" and "JSON boolean" in error["message"]
    assert core.sent == [] and core.held == []


def test_the_hold_bucket_charges_exactly_the_requests_that_hold():
    limiter = HoldRateLimiter(rate=0.001, burst=3)        # no refill during the test
    client, core, engine = _prefill(limiter)
    hold = {"prompt": [5, 6], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    for value in (1, "x", [1]):                            # refused: charged nothing
        bad = hold | {"kv_transfer_params": {"do_remote_decode": value}}
        assert client.post("/v1/completions", json=bad).status_code == 400
    for body in ({"prompt": [5, 6], "max_tokens": 1},      # hold nothing: charged nothing
                 hold | {"kv_transfer_params": {"do_remote_decode": False}},
                 hold | {"prompt": [5] * 200}):            # too long: refused before the engine
        client.post("/v1/completions", json=body)
    engine.admission.in_flight = 70                        # a full queue: 503, refunded
    assert client.post("/v1/completions", json=hold).status_code == 503
    engine.admission.in_flight = 0
    assert [client.post("/v1/completions", json=hold).status_code for _ in range(4)] == \
        [200, 200, 200, 429]
    assert len(core.held) == 3                             # the 3 charged are the 3 held


def test_large_bodies_are_prepared_on_a_worker_thread(monkeypatch):
    """Under INLINE_BYTES on the loop; larger, the parse and tokenising go to the pool."""
    threads: list[str] = []
    real = prep.prepare_body

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)
    monkeypatch.setattr(prep, "prepare_body", spy)
    core = FakeEngine()
    core.ready.set()
    client = TestClient(build_app(_state(core)))
    small = {"prompt": [5, 6], "max_tokens": 1}
    large = {"prompt": [5, 6], "max_tokens": 1, "user": "u" * (prep.INLINE_BYTES + 1)}
    assert client.post("/v1/completions", json=small).status_code == 200
    assert client.post("/v1/completions", json=large).status_code == 200
    assert not threads[0].startswith("kvrelay-prep") and threads[1].startswith("kvrelay-prep")


def test_the_body_is_parsed_once_and_errors_stay_openai_errors(monkeypatch):
    parses: list[int] = []
    real = prep.http_body.parse_text
    monkeypatch.setattr(prep.http_body, "parse_text",
                        lambda body: parses.append(len(body.text)) or real(body))
    core = FakeEngine()
    core.ready.set()
    client = TestClient(build_app(_state(core)))
    assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}
                       ).status_code == 200
    assert len(parses) == 1
    # FastAPI's own JSON parse never runs: a body it would have parsed again is not re-read
    for raw, param in ((b'{"prompt": [5], "temperature": NaN}', None),
                       (b'{"prompt": [5], "max_tokens": "many"}', "max_tokens"),
                       (b'[]', None), (b'{"prompt": [5], "x": "\\ud800"}', "x")):
        r = client.post("/v1/completions", content=raw,
                        headers={"content-type": "application/json"})
        assert _error(r, 400)["param"] == param
    r = client.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    _error(r, 400)                                            # FastAPI names the missing body


def test_a_harmony_panic_is_a_400_not_a_crash(monkeypatch):
    """openai-harmony's Rust panics (a stack overflow on a ~1 MB run of one character) are
    pyo3 PanicExceptions, BaseExceptions that no `except Exception` catches."""
    from kvrelay.server import harmony_chat
    from kvrelay.server.protocol import ChatCompletionRequest

    class PanicException(BaseException):
        pass

    def panic(*args: Any) -> list[int]:
        raise PanicException("called `Result::unwrap()` on an `Err` value: StackOverflow")
    monkeypatch.setattr(harmony_chat, "render_harmony", panic)
    chat = harmony_chat.HarmonyChat(None)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}]})
    with pytest.raises(OpenAIError, match="could not be rendered") as refused:
        chat.render(body)
    assert refused.value.param == "messages"


def test_a_harmony_chat_is_refused_before_rendering(byte_bpe, monkeypatch):
    """By its bytes, then (over COUNT_FIRST_BYTES) by counting its tokens in pieces: the
    renderer, which holds the GIL, never sees a conversation too long for the context."""
    from kvrelay.server import harmony_chat
    from kvrelay.server.protocol import ChatCompletionRequest
    chat = harmony_chat.HarmonyChat(byte_bpe)
    rendered: list[int] = []
    real = harmony_chat.render_harmony
    monkeypatch.setattr(harmony_chat, "render_harmony",
                        lambda *a: rendered.append(1) or real(*a))
    monkeypatch.setattr(harmony_chat, "COUNT_FIRST_BYTES", 1000)
    longest = chat.facts.longest_token_bytes
    assert longest

    def body(text: str) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": text}]})
    with pytest.raises(OpenAIError, match="at least 100 tokens"):       # by its bytes
        chat.render(body("=" * (longest * 100)), limit=100)
    with pytest.raises(OpenAIError, match="at least") as refused:       # by counting
        chat.render(body("hello world, the fox. " * 100), limit=100)
    assert refused.value.param == "messages" and rendered == []
    assert len(chat.render(body("hello world"), limit=100).prompt_ids) > 2 and rendered == [1]


def test_runs_that_would_stall_harmonys_tokenizer_are_refused(byte_bpe, monkeypatch):
    """openai-harmony's tokenizer is quadratic in a run's length (100,000 letters: 9.9 s with
    the GIL held): long runs are weighed, as the o200k pieces they are, before it runs."""
    from kvrelay.server import harmony_chat, harmony_guard
    from kvrelay.server.protocol import ChatCompletionRequest
    hf = byte_bpe.tokenizer
    words, work = harmony_guard.long_runs(["hello world, the quick brown fox. " * 1000])
    assert words == [] and work == 0                         # prose: one split, nothing more
    words, work = harmony_guard.long_runs(["x " + "a" * 100 + " y" + " " * 200 + "z"])
    assert words == ["a" * 100] and work == 200 ** 2
    assert harmony_guard.piece_work(hf, ["ab,cd" * 20]) < 100 ** 2     # split at the commas
    assert harmony_guard.piece_work(hf, ["a" * 100]) == 100 ** 2      # one piece
    harmony_guard.check_piece_work(hf, ["a" * 16_000], 0)            # 2.56e8: just fits
    with pytest.raises(OpenAIError, match="break them up") as refused:
        harmony_guard.check_piece_work(hf, ["a" * 17_000], 0)
    assert refused.value.param == "messages"
    chat = harmony_chat.HarmonyChat(byte_bpe)
    monkeypatch.setattr(harmony_chat, "render_harmony", lambda *a: pytest.fail("rendered"))
    for content in ("a" * 100_000, "中文字符" * 25_000, " " * 20_000 + "x"):
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": content}]})
        with pytest.raises(OpenAIError, match="break them up"):
            chat.render(body)                                 # with or without a limit
