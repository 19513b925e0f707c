"""The Responses API end to end on a real `kvrelay serve` (the tiny random-weight o200k
gpt-oss, its output scripted and paced by tests/agent/paced.py): a background response
polled to completed with exact usage, one cancelled mid-way (the engine request aborted
and its KV blocks freed), a background stream resumed with starting_after, and the SQLite
store surviving a restart of the server on the same state directory."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.harmony import get_encoding
from tests.agent.conftest import MODEL
from tests.agent.paced import LONG
from tests.agent.test_response_lifecycle import poll_statuses
from tests.harmony_factories import scripted_harmony_answer
from tests.processes import KvrelayProcess, Server, free_port

REASONING, ANSWER = "Let me think.", "Hello there, world."
PROMPT = "Say hello to the whole world, please, in a few friendly words."
DELAY_S = 0.02                  # per output token: a long response runs for seconds


def _scripts() -> dict[str, list[int]]:
    return {"answer": scripted_harmony_answer(REASONING, ANSWER),
            # the final channel's text, its last token repeated until max_output_tokens
            "long": scripted_harmony_answer("", "word word word")[:-1]}


class _Served:
    """The module's server: one port and state directory, restartable."""

    def __init__(self, checkpoint: Path, state: Path, logs: Path) -> None:
        self.checkpoint, self.state, self.logs = checkpoint, state, logs
        self.port = free_port()
        self.starts = 0
        self.server: Server | None = None

    def start(self) -> None:
        self.starts += 1
        server = Server.__new__(Server)
        server.port, server.url = self.port, f"http://127.0.0.1:{self.port}"
        KvrelayProcess.__init__(server, [
            "serve", str(self.checkpoint), "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", "2048", "--served-model-name", MODEL,
            "--responses-store", "sqlite", "--state-dir", str(self.state),
            "--logits-processors", "tests.agent.paced:paced"],
            self.logs / f"serve-{self.starts}.log",
            env={"KVRELAY_PACED_SCRIPTS": json.dumps(_scripts()),
                 "KVRELAY_PACED_DELAY_S": str(DELAY_S)})
        self.server = server
        server.wait_ready()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def client(self) -> openai.OpenAI:
        assert self.server is not None
        return openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="key", max_retries=0)


@pytest.fixture(scope="module")
def served(o200k_checkpoint, tmp_path_factory):
    served = _Served(o200k_checkpoint, tmp_path_factory.mktemp("state"),
                     tmp_path_factory.mktemp("background-logs"))
    try:
        served.start()
        yield served
    finally:
        served.stop()


def _poll(client: openai.OpenAI, response_id: str, until: set[str],
          timeout: float = 60) -> list[str]:
    return poll_statuses(client, response_id, until, timeout, every_s=0.02)


def _idle(served: _Served, timeout: float = 30) -> dict[str, float]:
    """The metrics once the engine runs nothing and holds no KV block."""
    assert served.server is not None
    deadline = time.monotonic() + timeout
    while True:
        m = served.server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["kvrelay:kv_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle: {m}")
        time.sleep(0.05)


def test_background_is_polled_to_completed_with_exact_usage(served):
    client = served.client
    foreground = client.responses.create(model=MODEL, input=PROMPT)
    queued = client.responses.create(model=MODEL, input=PROMPT, background=True)
    assert queued.status == "queued" and queued.background and queued.usage is None
    seen = _poll(client, queued.id, {"completed", "failed", "incomplete"})
    assert seen[-1] == "completed" and set(seen) <= {"queued", "in_progress", "completed"}
    done = client.responses.retrieve(queued.id)
    assert done.output_text == ANSWER == foreground.output_text
    with client.responses.stream(model=MODEL, input=PROMPT) as stream:
        streamed = stream.get_final_response()
    script = _scripts()["answer"]
    for response in (foreground, done, streamed):
        usage = response.usage
        assert usage.input_tokens == foreground.usage.input_tokens > 16
        assert usage.output_tokens == len(script)
        assert usage.output_tokens_details.reasoning_tokens == len(get_encoding().encode(REASONING))
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # the same prompt again: its full blocks (16 tokens each) come from the prefix cache
    for response in (done, streamed):
        cached = response.usage.input_tokens_details.cached_tokens
        assert cached > 0 and cached % 16 == 0, cached


def test_a_background_response_cancelled_mid_way_frees_its_request(served):
    client = served.client
    queued = client.responses.create(model=MODEL, input=PROMPT, background=True,
                                     max_output_tokens=LONG)
    assert _poll(client, queued.id, {"in_progress", "completed"})[-1] == "in_progress"
    time.sleep(0.3)
    assert served.server is not None
    assert served.server.metrics()["kvrelay:kv_blocks_used"] > 0     # still running
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert 0 < cancelled.usage.output_tokens < LONG
    assert cancelled.output_text.startswith("word word")
    _idle(served)                                    # aborted in the engine: no block held
    assert client.responses.cancel(queued.id) == cancelled == client.responses.retrieve(queued.id)


def test_a_background_stream_resumes_after_starting_after(served):
    client = served.client
    first: list = []
    with client.responses.create(model=MODEL, input=PROMPT, background=True, stream=True,
                                 max_output_tokens=LONG) as stream:
        for event in stream:
            first.append(event)
            if event.sequence_number == 8:
                break                                # the client leaves; the run goes on
    response_id = first[0].response.id
    assert [e.sequence_number for e in first] == list(range(9))
    resumed: list = []
    with client.responses.retrieve(response_id, stream=True, starting_after=8) as stream:
        for event in stream:
            resumed.append(event)
            if event.sequence_number == 40:
                client.responses.cancel(response_id)   # ends the stream after its last events
    numbers = [e.sequence_number for e in resumed]
    assert numbers == list(range(9, 9 + len(resumed))) and numbers[-1] > 40
    text = "".join(e.delta for e in first + resumed if e.type == "response.output_text.delta")
    final = client.responses.retrieve(response_id)
    assert final.status == "cancelled" and text == final.output_text
    _idle(served)


def test_stored_responses_survive_a_restart(served):
    client = served.client
    stored = client.responses.create(model=MODEL, input=PROMPT)
    background = client.responses.create(model=MODEL, input=PROMPT, background=True)
    _poll(client, background.id, {"completed"})
    background = client.responses.retrieve(background.id)
    running = client.responses.create(model=MODEL, input=PROMPT, background=True,
                                      max_output_tokens=LONG)
    _poll(client, running.id, {"in_progress"})
    assert (served.state / f"responses-{served.port}.sqlite3").is_file()
    served.stop()
    served.start()
    client = served.client
    assert client.responses.retrieve(stored.id) == stored
    assert client.responses.retrieve(background.id) == background
    interrupted = client.responses.retrieve(running.id)  # nothing runs it any more
    assert interrupted.status == "failed" and interrupted.error.code == "server_error"
    follow = client.responses.create(model=MODEL, input="And again?",
                                     previous_response_id=stored.id)
    assert follow.status == "completed" and follow.output_text == ANSWER
    # its prompt held the stored turn (the answer; the answered turn's analysis is dropped)
    assert follow.usage.input_tokens > (stored.usage.input_tokens
                                        + len(get_encoding().encode(ANSWER)))
    # another key still sees none of them
    r = httpx.get(f"{served.server.url}/v1/responses/{stored.id}",
                  headers={"Authorization": "Bearer other"})
    assert r.status_code == 404
