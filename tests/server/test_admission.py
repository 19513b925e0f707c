"""Bounded admission (kvrelay/server/admission.py), in process over a fake engine: the
per-request cap on prompts × n (400 naming the field), the queue bound (503 with
Retry-After, nothing of the refused request reaches the engine, the admitted ones
finish), and the in-flight count going back to zero on every way a stream ends."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.admission import (
    Admission,
    AdmissionLimits,
    AdmittedEngine,
    QueueFull,
)
from kvrelay.server.api import ServerState, build_app
from kvrelay.server.protocol import OpenAIError


@dataclass
class GatedEngine:
    """Answers each request with one token once `gate` is set; records what it was sent
    and what was aborted (an abort: the stream closed before its output)."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None
    dead: str | None = None
    info: Any = None
    sent: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ready.set()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.sent.append(request_id)
        done = False
        try:
            if self.gate is not None:
                await self.gate.wait()
            outs = [CompletionOutput(i, "w5", [5], "length", delta_token_ids=[5])
                    for i in range(params.n)]
            done = True
            yield RequestOutput(request_id, None, list(prompt), outs, finished=True)
        finally:
            if not done:
                self.aborted.append(request_id)


def _engine(running: int, queued: int, per_request: int = 8,
            gate: asyncio.Event | None = None) -> tuple[AdmittedEngine, GatedEngine]:
    core = GatedEngine(gate=gate)
    admission = Admission(AdmissionLimits(running, queued, per_request))
    return AdmittedEngine(core, admission), core  # type: ignore[arg-type]


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=1)


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


# -- the limits themselves -------------------------------------------------------------------

def test_limits_are_checked_naming_the_flag():
    with pytest.raises(ValueError, match="--max-queued-requests"):
        AdmissionLimits(4, -1)
    with pytest.raises(ValueError, match="--max-seqs-per-request"):
        AdmissionLimits(4, 0, 0)
    assert AdmissionLimits(4, 3).capacity == 7


def test_size_cap_names_n_or_prompt():
    admission = Admission(AdmissionLimits(2, 2, 6))
    admission.check_size(3, 2)                               # 6: at the cap
    with pytest.raises(OpenAIError) as e:
        admission.check_size(1, 7)
    assert (e.value.status, e.value.param) == (400, "n")
    with pytest.raises(OpenAIError) as e:
        admission.check_size(4, 2)
    assert (e.value.status, e.value.param) == (400, "prompt") and "8 sequences" in e.value.message


def test_queue_bound_counts_sequences_and_an_idle_server_takes_any_request():
    admission = Admission(AdmissionLimits(running=2, max_queued=1, max_per_request=8))
    admission.admit(5)                                       # idle: taken though above capacity
    with pytest.raises(QueueFull):
        admission.admit(1)
    admission.in_flight = 0
    admission.admit(2)
    assert admission.queued == 0
    admission.admit(1)
    assert admission.queued == 1
    with pytest.raises(QueueFull) as e:
        admission.admit(1)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    assert admission.refused == 2 and admission.in_flight == 3


# -- the count goes back on every way a stream ends ------------------------------------------

def test_finished_failed_aborted_and_never_started_streams_give_their_sequences_back():
    async def main() -> None:
        engine, core = _engine(running=1, queued=1)
        admission = engine.admission
        gen = engine.generate("a", [1, 2], _params(2))
        assert admission.in_flight == 2
        assert [o.finished async for o in gen] == [True]     # finished
        assert admission.in_flight == 0

        core.gate = asyncio.Event()
        gen = engine.generate("b", [1], _params())
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert admission.in_flight == 1
        task.cancel()                                        # a client that went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()
        assert admission.in_flight == 0 and core.aborted == ["b"]

        gen = engine.generate("c", [1], _params())           # made, never iterated
        assert admission.in_flight == 1
        del gen
        gc.collect()
        assert admission.in_flight == 0 and "c" not in core.sent

    asyncio.run(main())


def test_a_refused_request_reaches_no_engine_and_the_admitted_ones_finish():
    async def main() -> None:
        gate = asyncio.Event()
        engine, core = _engine(running=1, queued=1, gate=gate)
        first = engine.generate("a", [1], _params())
        second = engine.generate("b", [1], _params())
        outs = [asyncio.ensure_future(_drain(g)) for g in (first, second)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            engine.generate("c", [1], _params())
        assert core.sent == ["a", "b"]
        gate.set()
        assert await asyncio.gather(*outs) == [1, 1]          # nothing admitted was lost
        assert engine.admission.in_flight == 0
        assert [o.finished async for o in engine.generate("d", [1], _params())] == [True]

    asyncio.run(main())


def test_a_batch_is_admitted_whole_or_not_at_all():
    engine, core = _engine(running=2, queued=2, per_request=8)
    engine.admission.in_flight = 1
    with pytest.raises(QueueFull), engine.batch(2, 2):       # 1 + 4 > 4
        pytest.fail("a batch past the queue bound must not start")
    assert engine.admission.in_flight == 1
    with engine.batch(1, 3):                                 # 1 + 3: fits, then is taken
        gens = [engine.generate("a", [1], _params(3))]
    assert engine.admission.in_flight == 4
    with engine.batch(0, 1):                                 # a batch that used nothing
        pass
    assert engine.admission.in_flight == 4
    del gens
    gc.collect()
    assert engine.admission.in_flight == 1 and core.sent == []


async def _drain(gen: AsyncIterator[RequestOutput]) -> int:
    return len([o async for o in gen])


# -- over HTTP: the bodies -------------------------------------------------------------------

def _client(engine: AdmittedEngine) -> TestClient:
    state = ServerState(engine=engine, tokenizer=None, served_names=["m"],  # type: ignore[arg-type]
                        max_model_len=96, max_logprobs=5)
    return TestClient(build_app(state))


def test_too_many_sequences_in_one_request_is_400_naming_the_field():
    engine, core = _engine(running=4, queued=4, per_request=4)
    client = _client(engine)
    r = client.post("/v1/completions", json={"prompt": [[5, 6]] * 3, "n": 2, "max_tokens": 1})
    error = _openai_error(r, 400)
    assert error["param"] == "prompt" and "--max-seqs-per-request 4" in error["message"]
    r = client.post("/v1/completions", json={"prompt": [5, 6], "n": 5, "max_tokens": 1})
    assert _openai_error(r, 400)["param"] == "n"
    r = client.post("/v1/completions", json={"prompt": [5, 6], "n": 200, "max_tokens": 1})
    assert _openai_error(r, 400)["param"] == "n"             # OpenAI's own cap (128)
    r = client.post("/v1/completions", json={"prompt": ["w5 w6"] * 100_000, "max_tokens": 1})
    error = _openai_error(r, 400)                            # before tokenising (the fake
    assert error["param"] == "prompt" and "100000 prompts" in error["message"]   # has none)
    assert core.sent == [] and engine.admission.in_flight == 0
    r = client.post("/v1/completions", json={"prompt": [[5, 6]] * 2, "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_full_queue_is_503_with_retry_after_for_every_endpoint():
    engine, core = _engine(running=1, queued=1)
    client = _client(engine)
    engine.admission.in_flight = 2                           # as if two were in flight
    for body in ({"prompt": [5, 6], "max_tokens": 1},
                 {"prompt": [5, 6], "max_tokens": 1, "stream": True}):
        r = client.post("/v1/completions", json=body)
        error = _openai_error(r, 503)
        assert error["type"] == "ServiceUnavailableError" and r.headers["Retry-After"] == "1"
        assert "--max-queued-requests 1" in error["message"]
    assert core.sent == []
    engine.admission.in_flight = 0
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
    assert r.status_code == 200 and engine.admission.in_flight == 0


# -- the flags ------------------------------------------------------------------------------

def test_serve_flags_defaults_and_one_line_errors(serve_config):
    from kvrelay.server.admission import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_SEQS_PER_REQUEST
    from kvrelay.server.http_server import uvicorn_proxy_options
    from kvrelay.server.options import HTTPOptions
    opts = serve_config().http
    assert opts == HTTPOptions()                   # the flags' defaults are the options' own
    assert (opts.max_queued_requests, opts.max_seqs_per_request, opts.forwarded_allow_ips) == (
        DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_SEQS_PER_REQUEST, None)
    assert opts.limits(running=8).capacity == 8 + DEFAULT_MAX_QUEUED_REQUESTS
    assert uvicorn_proxy_options(None) == {"proxy_headers": False}     # uvicorn's default: True
    assert uvicorn_proxy_options("10.0.0.1,10.0.0.2") == {
        "proxy_headers": True, "forwarded_allow_ips": "10.0.0.1,10.0.0.2"}
    for flag in ("--max-queued-requests", "--max-seqs-per-request"):
        with pytest.raises(ValueError, match=flag):
            serve_config(flag, "-1")


def test_proxy_trusts_no_forwarded_headers_unless_told():
    from kvrelay.proxy.main import build_parser, settings_from_args
    assert settings_from_args(build_parser().parse_args([])).forwarded_allow_ips is None
    args = build_parser().parse_args(["--forwarded-allow-ips", "10.1.2.3"])
    assert settings_from_args(args).forwarded_allow_ips == "10.1.2.3"
