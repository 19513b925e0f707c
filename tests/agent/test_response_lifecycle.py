"""The Responses API's lifecycle in-process (server/routes/responses.py,
response_background.py), over the real app with a scripted engine that can be held, failed
and watched for aborts, driven through the openai client where it has the call: background
responses polled (queued → in_progress → completed), cancelled mid-way (the engine request
closed, the output so far kept), failed, deleted; a background stream resumed after any
sequence number; `usage` exact on every path; and `previous_response_id` carrying function
calls and their outputs into the next prompt, token for token as openai-harmony renders it."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import openai
import pytest
from starlette.testclient import TestClient

from kvrelay.engine.client import RequestFailed
from kvrelay.engine.outputs import RequestOutput
from kvrelay.harmony import get_encoding
from kvrelay.server import response_background
from kvrelay.server.api import build_app
from kvrelay.server.response_background import BackgroundResponses, EventLog
from kvrelay.server.response_request import ResponsesRequest, prepare
from kvrelay.server.response_store import MemoryResponseStore, StoreLimits
from kvrelay.server.tools import AgentOptions
from tests.agent.fakes import MODEL, ScriptedEngine, make_state
from tests.agent.test_agent_api import _decode
from tests.agent.test_harmony_tools import (
    TIME,
    WEATHER,
    _analysis,
    _call,
    _developer,
    _harmony_ids,
    _result,
    _system,
    _user,
)
from tests.harmony_factories import scripted_harmony_answer, scripted_tool_call

REASONING, ANSWER = "Let me think about it.", "Hello there, world."
AUTH = {"Authorization": "Bearer x"}          # the openai client's key: the same owner
RTOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": WEATHER},
          {"type": "function", "name": "get_time", "parameters": TIME}]


@dataclass
class HeldEngine(ScriptedEngine):
    """A ScriptedEngine that holds each request after `hold_after` tokens until `release`
    is set (from the test's thread; `held` says it is holding one), reports `cached` prompt
    tokens, fails after `fail_after` tokens, and records the requests closed before their end
    (aborts)."""
    hold_after: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)
    cached: int = 0
    fail_after: int | None = None
    aborted: list[str] = field(default_factory=list)

    async def generate(self, request_id, prompt, params, kv_transfer_params=None
                       ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            async for out in super().generate(request_id, prompt, params, kv_transfer_params):
                out.num_cached_tokens = self.cached
                tokens = len(out.outputs[0].token_ids)
                if self.fail_after is not None and tokens > self.fail_after:
                    raise RequestFailed("the step failed")
                finished = out.finished
                yield out
                while (self.hold_after is not None and tokens >= self.hold_after
                       and not finished and not self.release.is_set()):
                    self.held.set()
                    await asyncio.sleep(0.002)
        finally:
            if not finished:
                self.aborted.append(request_id)


@pytest.fixture
def served() -> Iterator:
    """make(script, **engine fields) → (engine, openai client, http); the app keeps one
    event loop for the test (TestClient entered), so background tasks run between calls."""
    opened: list[TestClient] = []

    def make(script: list[int], agent: AgentOptions | None = None, **engine_fields):
        engine = HeldEngine(lambda prompt: script, _decode, **engine_fields)
        http = TestClient(build_app(make_state(engine, True, agent)), base_url="http://testserver")
        http.__enter__()
        opened.append(http)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                               max_retries=0)
        return engine, client, http
    yield make
    for http in opened:
        http.__exit__(None, None, None)


def _answer() -> list[int]:
    return scripted_harmony_answer(REASONING, ANSWER)


def poll_statuses(client, response_id: str, until: set[str], timeout: float = 10,
                  every_s: float = 0.005) -> list[str]:
    """The statuses a response went through until one in `until` (each once, in order)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.responses.retrieve(response_id).status
        if not seen or seen[-1] != status:
            seen.append(status)
        if status in until:
            return seen
        time.sleep(every_s)
    raise AssertionError(f"{response_id}: still {seen[-1]} after {timeout}s")


_poll = poll_statuses


def _events(text: str) -> list[dict]:
    """The SSE data of a response stream, in order."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


# ------------------------------------------------------------------ background


def test_background_is_queued_then_polled_to_completed(served):
    engine, client, _ = served(_answer(), hold_after=3)
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    assert queued.usage is None
    assert _poll(client, queued.id, {"in_progress"}) in (["queued", "in_progress"],
                                                         ["in_progress"])
    assert client.responses.retrieve(queued.id).output == []      # held after 3 tokens
    engine.release.set()
    assert _poll(client, queued.id, {"completed"})[-1] == "completed"
    done = client.responses.retrieve(queued.id)
    assert done.output_text == ANSWER and done.background is True and done.error is None
    assert [i.type for i in done.output] == ["reasoning", "message"]
    assert done.usage.output_tokens == len(_answer()) and not engine.aborted
    # the same request in the foreground gives the same answer
    foreground = client.responses.create(model=MODEL, input="Hi")
    assert foreground.background is False and foreground.output_text == done.output_text


def test_cancel_mid_way_closes_the_engine_request_and_keeps_the_output_so_far(served):
    script = scripted_harmony_answer("", ANSWER)          # final channel only
    engine, client, http = served(script, hold_after=5)    # never released
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    assert engine.held.wait(10)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.error is None
    assert engine.aborted == [queued.id]                   # the engine request was closed
    assert len(http.app.state.background_responses) == 0
    (message,) = cancelled.output
    assert message.type == "message" and message.status == "incomplete"
    assert message.content[0].text == _decode(script[3:5])      # after the 3-token header
    assert cancelled.usage.output_tokens == 5
    assert cancelled.usage.total_tokens == cancelled.usage.input_tokens + 5
    # idempotent: a second cancel, and a GET, return the cancelled response unchanged
    assert client.responses.cancel(queued.id) == cancelled
    assert client.responses.retrieve(queued.id) == cancelled
    # a cancelled response can be continued (its conversation holds the output so far)
    engine.release.set()
    follow = client.responses.create(model=MODEL, input="Go on",
                                     previous_response_id=queued.id)
    assert follow.status == "completed"


def test_a_cancel_before_the_run_begins_never_reaches_the_engine():
    engine = HeldEngine(lambda prompt: _answer(), _decode)
    state = make_state(engine, True)
    store = MemoryResponseStore(StoreLimits())
    background = BackgroundResponses(state, store)
    p = prepare(state, store, ResponsesRequest(model=MODEL, input="Hi", background=True), "")

    async def run() -> None:
        background.start(p, lambda: engine.generate(p.response_id, p.rendered.prompt_ids,
                                                    p.params))
        await background.cancel(p.response_id, "")     # its task has not run yet
    asyncio.run(run())
    stored = store.get(p.response_id, "")
    assert stored is not None and stored.body["status"] == "cancelled"
    assert stored.body["usage"]["output_tokens"] == 0 and stored.body["output"] == []
    assert engine.requests == [] and len(background) == 0


def test_cancel_follows_openai(served):
    _, client, _ = served(_answer())
    foreground = client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    done = client.responses.create(model=MODEL, input="Hi", background=True)
    assert _poll(client, done.id, {"completed"})[-1] == "completed"
    assert client.responses.cancel(done.id) == client.responses.retrieve(done.id)
    assert client.responses.retrieve(done.id).status == "completed"     # finished: unchanged


def test_another_key_cannot_cancel_or_read_a_running_response(served):
    engine, client, http = served(_answer(), hold_after=2)
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    path = f"/v1/responses/{queued.id}"
    other = {"Authorization": "Bearer someone-else"}
    for method, where in (("POST", f"{path}/cancel"), ("GET", path),
                          ("GET", f"{path}?stream=true"), ("DELETE", path)):
        assert http.request(method, where, headers=other).status_code == 404, (method, where)
    assert len(http.app.state.background_responses) == 1 and not engine.aborted
    engine.release.set()
    assert _poll(client, queued.id, {"completed"})[-1] == "completed"


def test_background_needs_the_store(served):
    _, client, http = served(_answer())
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert e.value.body["param"] == "store"
    _, off, _ = served(_answer(), AgentOptions(responses_store_size=0))
    with pytest.raises(openai.BadRequestError) as e:
        off.responses.create(model=MODEL, input="Hi", background=True)
    assert e.value.body["param"] == "background"
    # a proxy's prefill leg (do_remote_decode) is answered at once and kept nowhere
    r = http.post("/v1/responses", headers=AUTH, json={
        "model": MODEL, "input": "Hi", "background": True, "store": False,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert r.json()["background"] is False
    assert http.get(f"/v1/responses/{r.json()['id']}", headers=AUTH).status_code == 404


def test_delete_cancels_a_running_background_response(served):
    engine, client, http = served(_answer(), hold_after=2)
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    assert engine.held.wait(10)
    client.responses.delete(queued.id)
    assert engine.aborted == [queued.id] and len(http.app.state.background_responses) == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def test_an_engine_failure_fails_the_background_response(served):
    _, client, http = served(_answer(), fail_after=4)
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    assert _poll(client, queued.id, {"failed", "completed"})[-1] == "failed"
    failed = client.responses.retrieve(queued.id)
    assert failed.error.code == "server_error" and "the step failed" in failed.error.message
    assert failed.usage.output_tokens == 4
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "background": True,
                                         "stream": True})
    events = _events(r.text)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"


def test_a_running_response_cannot_be_continued_yet(served):
    engine, client, _ = served(_answer(), hold_after=2)
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    with pytest.raises(openai.BadRequestError, match="has not finished") as e:
        client.responses.create(model=MODEL, input="more", previous_response_id=queued.id)
    assert e.value.body["param"] == "previous_response_id"
    engine.release.set()
    _poll(client, queued.id, {"completed"})


# ------------------------------------------------------------------ streams and resuming


def test_a_background_stream_resumes_after_any_sequence_number(served):
    _, client, _ = served(_answer())
    events = list(client.responses.create(model=MODEL, input="Hi", background=True,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert events[0].response.status == "queued" and events[0].response.background is True
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    response_id = events[0].response.id
    assert text == ANSWER == client.responses.retrieve(response_id).output_text
    for after in (0, 2, len(events) // 2, len(events) - 2):
        tail = list(client.responses.retrieve(response_id, stream=True, starting_after=after))
        assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[after + 1:]]
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(events)))


def test_only_a_streamed_background_response_streams_again(served, monkeypatch):
    _, client, http = served(_answer())
    polled = client.responses.create(model=MODEL, input="Hi", background=True)
    foreground = client.responses.create(model=MODEL, input="Hi")
    _poll(client, polled.id, {"completed"})
    for response_id in (polled.id, foreground.id):
        r = http.get(f"/v1/responses/{response_id}?stream=true", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert http.get("/v1/responses/resp_unknown?stream=true", headers=AUTH).status_code == 404
    # a log over its bound drops its oldest events: asking for them is a 400
    monkeypatch.setattr(response_background, "EVENT_LOG_MAX_BYTES", 2000)
    r = http.post("/v1/responses", headers=AUTH, json={"model": MODEL, "input": "Hi",
                                                       "background": True, "stream": True})
    # (this reader may itself have fallen behind: then its stream ends with an error event)
    assert _events(r.text)[-1]["type"] in ("response.completed", "error")
    background = http.app.state.background_responses
    deadline = time.monotonic() + 10
    while len(background) and time.monotonic() < deadline:     # the run goes on without it
        time.sleep(0.005)
    (response_id, (_, log)), = background._logs.logs.items()
    last = log.next - 1
    assert log.first > 0 and last > 10
    r = http.get(f"/v1/responses/{response_id}?stream=true&starting_after=0", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
    tail = list(client.responses.retrieve(response_id, stream=True, starting_after=last - 1))
    assert [(e.type, e.sequence_number) for e in tail] == [("response.completed", last)]


def test_event_log_followers_wait_for_events_and_learn_when_they_fell_behind():
    async def run() -> tuple[list[int], list[str]]:
        log = EventLog(max_bytes=10_000)
        got: list[int] = []

        async def follow() -> None:
            async for text in log.follow(None):
                got.append(json.loads(text.split("data: ", 1)[1])["sequence_number"])
        reader = asyncio.create_task(follow())
        for i in range(5):
            log.append({"type": "response.output_text.delta", "delta": str(i)})
            await asyncio.sleep(0)
        log.close()
        await asyncio.wait_for(reader, 5)
        small = EventLog(max_bytes=300)
        behind = small.follow(0)
        for _ in range(10):
            small.append({"type": "response.output_text.delta", "delta": "x" * 50})
        small.close()
        kinds = [json.loads(t.split("data: ", 1)[1])["type"] async for t in behind]
        return got, kinds
    got, kinds = asyncio.run(run())
    assert got == [0, 1, 2, 3, 4]
    assert kinds == ["error"]            # its next event was dropped before it read it


# ------------------------------------------------------------------ usage on every path


def test_usage_is_exact_on_every_path(served):
    enc = get_encoding()
    script = _answer()
    engine, client, _ = served(script, cached=16)
    expected = {"input_tokens": None, "input_tokens_details": {"cached_tokens": 16},
                "output_tokens": len(script),
                "output_tokens_details": {"reasoning_tokens": len(enc.encode(REASONING))},
                "total_tokens": None}
    whole = client.responses.create(model=MODEL, input="Hi")
    prompt = len(engine.requests[-1][0])
    expected.update(input_tokens=prompt, total_tokens=prompt + len(script))
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        streamed = stream.get_final_response()
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    _poll(client, queued.id, {"completed"})
    polled = client.responses.retrieve(queued.id)
    events = list(client.responses.create(model=MODEL, input="Hi", background=True,
                                          stream=True))
    assert events[-1].type == "response.completed"
    for response in (whole, streamed, polled, events[-1].response):
        usage = response.usage.model_dump(exclude_none=True)
        usage["input_tokens_details"].pop("cache_write_tokens", None)
        assert usage == expected, response.id


# ------------------------------------------------------------------ previous_response_id


def test_previous_response_keeps_function_calls_and_their_outputs(served):
    """vLLM #43244: the call of the previous response and the new function_call_output are
    both in the prompt, exactly as openai-harmony renders that conversation."""
    enc = get_encoding()
    engine, client, _ = served(scripted_tool_call("get_weather", '{"city":"Paris"}',
                                                  reasoning="Need the tool."))
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=RTOOLS)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert engine.requests[-1][0] == _harmony_ids(enc, _system(), _developer(),
                                                  _user("Weather in Paris?"))
    client.responses.create(model=MODEL, tools=RTOOLS, previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
    assert engine.requests[-1][0] == _harmony_ids(
        enc, _system(), _developer(), _user("Weather in Paris?"), _analysis("Need the tool."),
        _call("get_weather", '{"city":"Paris"}'), _result("get_weather", '{"temp": 21}'))
