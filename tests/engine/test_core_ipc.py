"""The engine core ⇄ API process hop: one message per step for the whole batch, in the
msgpack codec of engine/codec.py, read by the API's event loop itself (no reader thread)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import signal
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from msgspec.structs import fields, replace

from kvrelay import SamplingParams
from kvrelay.config import EngineArgs
from kvrelay.engine import core_proc
from kvrelay.engine.async_client import AsyncEngine
from kvrelay.engine.codec import FROM_ENGINE, TO_ENGINE, MessagePipe, encode
from kvrelay.engine.messages import (
    EngineInfo,
    EngineStats,
    Ready,
    Shutdown,
    StepOutputs,
    as_delta,
)
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.engine.request import Logprob


class _BatchEngine:
    """What the core loop needs of an engine: `n` requests decoding `steps` tokens each."""

    connector = None
    expert_world = None
    transfer_busy = False
    last_step_idle = False

    def __init__(self, n: int, steps: int) -> None:
        self.tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
        self.steps, self.num_steps, self.num_dummy_steps = steps, 0, 0
        pool = SimpleNamespace(usage=0.0, num_free=10, num_used=0, num_blocks=11)
        self.kv = SimpleNamespace(pool=pool, stats=SimpleNamespace(queries=0, hits=0))
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)

    def has_unfinished_requests(self) -> bool:
        return self.num_steps < self.steps

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        done = self.num_steps == self.steps
        outs = []
        for i, (rid, ids) in enumerate(self.tokens.items()):
            ids.append(100 + i)
            c = CompletionOutput(0, "x" * len(ids), list(ids), "length" if done else None,
                                 delta_text="x", delta_token_ids=[100 + i])
            outs.append(RequestOutput(rid, "p", [1, 2, 3], [c], finished=done))
        return outs


def _pipes() -> tuple[MessagePipe, MessagePipe]:
    """Both ends of an API ⇄ core pipe, each decoding what may arrive there."""
    api, core = mp.Pipe()
    return MessagePipe(api, FROM_ENGINE), MessagePipe(core, TO_ENGINE)


def test_core_sends_one_message_per_step_with_the_whole_batch(tmp_path, monkeypatch):
    trace = tmp_path / "steps.txt"
    monkeypatch.setenv("KVRELAY_STEP_TRACE", str(trace))
    api, core = _pipes()
    engine = _BatchEngine(n=5, steps=4)
    loop = threading.Thread(target=core_proc._loop, args=(engine, core))
    loop.start()
    try:
        messages = [api.recv() for _ in range(4)]
        api.send(Shutdown())
        loop.join(10)
        assert not loop.is_alive()
        assert not api.poll(0.2)                           # nothing beyond one per step
    finally:
        api.close()
        core.close()
    assert all(isinstance(m, StepOutputs) for m in messages)
    assert [len(m.outputs) for m in messages] == [5] * 4   # every request's delta, together
    assert [m.stats.num_steps for m in messages] == [1, 2, 3, 4]
    for m in messages:
        assert [o.outputs[0].delta_token_ids for o in m.outputs] == [[100 + i] for i in range(5)]
        assert all(o.outputs[0].token_ids == [] for o in m.outputs)   # deltas only
    assert messages[-1].outputs[0].finished
    lines = [line.split() for line in trace.read_text().splitlines()]
    assert [int(x[3]) for x in lines] == [5] * 4           # KVRELAY_STEP_TRACE: a line a step
    assert all(float(a) <= float(b) <= float(c) for a, b, c, _ in lines)


class _QuietEngine(_BatchEngine):
    """Steps without outputs (a long prefill in chunks) whose stats change every step."""

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        return []


@contextmanager
def _core_loop(engine: _BatchEngine) -> Iterator[MessagePipe]:
    """`core_proc._loop` for `engine` on a thread; yields the API's end of the pipe, then
    shuts the loop down (it must stop within 10 s) and closes both ends."""
    api, core = _pipes()
    loop = threading.Thread(target=core_proc._loop, args=(engine, core))
    loop.start()
    try:
        yield api
        api.send(Shutdown())
        loop.join(10)
        assert not loop.is_alive()
    finally:
        api.close()
        core.close()


class _WaitingEngine(_BatchEngine):
    """Requests that all wait (their remote KV loading): every step runs nothing."""

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        self.last_step_idle = True
        return []


def test_the_core_waits_between_steps_while_every_request_waits():
    """A decode whose requests all wait for remote KV steps about once a millisecond (waiting
    on the pipe in between), not back to back: spinning took a core from a prefill server
    pinned beside it, which then could not answer the decode's transport for seconds."""
    engine = _WaitingEngine(n=1, steps=10**9)
    with _core_loop(engine):
        time.sleep(0.3)
        steps = engine.num_steps
    assert 10 <= steps <= 0.3 / core_proc.IDLE_STEP_WAIT_S + 50, steps   # spinning: > 10^4


def _quiet_messages(steps: int) -> list[StepOutputs]:
    with _core_loop(_QuietEngine(1, steps)) as api:
        messages = [api.recv()]
        while api.poll(0.3):
            messages.append(api.recv())
    return messages


def test_stats_alone_wait_for_the_engine_to_idle(monkeypatch):
    """Steps without outputs send no message while more steps follow (a message would wake
    the API process during the next step) unless STATS_EVERY_S passed since the last;
    the stats go out when the engine idles."""
    monkeypatch.setattr(core_proc, "STATS_EVERY_S", 60.0)
    assert [m.stats.num_steps for m in _quiet_messages(5)] == [5]
    monkeypatch.setattr(core_proc, "STATS_EVERY_S", 0.0)
    assert [m.stats.num_steps for m in _quiet_messages(3)] == [1, 2, 3]


class _NoProcess:
    """Stands in for the engine-core process (the test plays the core on the pipe)."""

    exitcode = -signal.SIGTERM

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


def _stats(steps: int) -> EngineStats:
    return EngineStats(num_steps=steps)


def test_api_reads_the_core_pipe_in_its_event_loop():
    async def scenario() -> tuple[list[Any], int, str | None]:
        engine = AsyncEngine(EngineArgs())
        core = MessagePipe(engine.process._args[1], TO_ENGINE)   # the core's end of the pipe
        engine.process = _NoProcess()                      # type: ignore[assignment]
        threads = threading.active_count()
        engine.start()
        started = threading.active_count() - threads       # no reader thread
        core.send(Ready(EngineInfo(64, "m", 0, 200), _stats(0)))
        await engine.wait_ready(5)
        gen = engine.generate("a", [1, 2], SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        add = core.recv()
        rid = add.request_id
        outs = []
        for step, done in ((1, False), (2, True)):
            c = CompletionOutput(0, "", [], "length" if done else None, delta_text="t",
                                 delta_token_ids=[7 + step])
            core.send(StepOutputs([RequestOutput(rid, None, [1, 2], [c], finished=done)],
                                  _stats(step)))
            outs.append(await (first if step == 1 else gen.__anext__()))
        core.close()                                       # the core exits
        for _ in range(100):
            if engine.dead:
                break
            await asyncio.sleep(0.01)
        return outs, started, engine.dead

    outs, started, dead = asyncio.run(scenario())
    assert started == 0
    assert [o.outputs[0].delta_token_ids for o in outs] == [[8], [9]]
    assert outs[-1].outputs[0].token_ids == [8, 9] and outs[-1].finished
    assert dead == "the engine process exited"


def _full_output() -> RequestOutput:
    """Every field set to something other than its default."""
    lp = {5: Logprob(5, -0.5, 1)}
    c = CompletionOutput(1, "abc", [4, 5], "stop", "</s>", [lp, lp], "c", [5], [lp])
    return RequestOutput("r", "prompt", [1, 2], [c], [None, lp], 3, True, {"k": 1}, "boom", 500)


def test_delta_drops_only_the_cumulative_fields():
    out = _full_output()
    c = out.outputs[0]
    first, later = as_delta(out), as_delta(out, first=False)
    expected = replace(out, outputs=[replace(c, text="", token_ids=[], logprobs=None)])
    assert first == expected
    assert later == replace(expected, prompt=None, prompt_token_ids=[])
    # every field of both classes is carried or dropped on purpose (a new one must be too)
    assert {f.name for f in fields(RequestOutput)} == {
        "request_id", "prompt", "prompt_token_ids", "outputs", "prompt_logprobs",
        "num_cached_tokens", "finished", "kv_transfer_params", "error", "error_status"}
    assert {f.name for f in fields(CompletionOutput)} == {
        "index", "text", "token_ids", "finish_reason", "stop_reason", "logprobs", "delta_text",
        "delta_token_ids", "delta_logprobs"}


def test_step_message_is_field_values_in_the_codec():
    stats = EngineStats(num_requests_running=2, kv_cache_usage_perc=0.25, num_steps=9,
                        kv_transfers=4, kv_transfer_seconds=0.5)
    message = StepOutputs([as_delta(_full_output()), as_delta(_full_output(), first=False)],
                          stats)
    data = encode(message)
    assert FROM_ENGINE.decode(data) == message
    assert b"num_requests_running" not in data and b"delta_token_ids" not in data
    one_token = StepOutputs([as_delta(RequestOutput("cmpl-0123456789abcdef-0", None, [], [
        CompletionOutput(0, "", [], delta_text=" the", delta_token_ids=[1996])]), False)],
        EngineStats(num_requests_running=1, num_steps=100))
    assert len(encode(one_token)) < 200                   # pickled dataclasses: ~1,050


def test_messages_of_the_wrong_direction_are_refused():
    from kvrelay.engine.codec import CodecError
    from kvrelay.engine.messages import AddRequest, Fatal
    assert TO_ENGINE.decode(encode(Shutdown())) == Shutdown()
    with pytest.raises(CodecError, match="malformed engine message"):
        TO_ENGINE.decode(encode(Fatal("x")))
    with pytest.raises(CodecError):
        FROM_ENGINE.decode(encode(AddRequest("r", [1], SamplingParams())))
    with pytest.raises(CodecError):
        FROM_ENGINE.decode(b"\x80\x03not msgpack")


def test_a_step_message_larger_than_the_socket_buffer_arrives_whole():
    """An event loop may make the pipe it watches non-blocking (libuv does): a message
    bigger than the socket's buffer then arrives in pieces, and reading it must wait for the
    rest instead of failing the engine (a 64-stream step once did: "engine process exited")."""
    async def scenario() -> tuple[int, str | None]:
        engine = AsyncEngine(EngineArgs())
        core = MessagePipe(engine.process._args[1], TO_ENGINE)
        engine.process = _NoProcess()                      # type: ignore[assignment]
        engine.start()
        os.set_blocking(engine._conn.fileno(), False)
        core.send(Ready(EngineInfo(64, "m", 0, 200), _stats(0)))
        await engine.wait_ready(5)
        gen = engine.generate("a", [1, 2], SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        rid = core.recv().request_id
        big = list(range(400_000))                         # ~1.2 MB encoded, > the buffer
        c = CompletionOutput(0, "", [], "length", delta_text="t", delta_token_ids=big)
        payload = encode(StepOutputs([RequestOutput(rid, None, [1, 2], [c], finished=True)],
                                     _stats(1)))
        wire = struct.pack("!i", len(payload)) + payload   # multiprocessing's framing

        def send_in_two_parts() -> None:                   # the core writing a big message
            head, tail = wire[:1000], memoryview(wire)[1000:]
            os.write(core.fileno(), head)
            time.sleep(0.3)                                # the reader finds the pipe empty
            while tail:
                tail = tail[os.write(core.fileno(), tail):]

        sender = threading.Thread(target=send_in_two_parts)
        sender.start()
        out = await asyncio.wait_for(first, 10)
        sender.join(10)
        core.close()
        return len(out.outputs[0].token_ids), engine.dead

    n, dead = asyncio.run(scenario())
    assert n == 400_000
    assert dead is None


def test_frame_reader_returns_whole_messages_however_the_bytes_arrive():
    """The API reads the core's pipe with one non-blocking recv per wake-up: several
    messages in one read, a header or payload split across reads, and end of file."""
    import socket

    from kvrelay.engine.async_client import FrameReader

    a, b = socket.socketpair()
    reader = FrameReader(b.fileno())
    try:
        payloads = [pickle.dumps(("m", i, "x" * i)) for i in (0, 5, 300, 70_000)]
        wire = b"".join(struct.pack("!i", len(p)) + p for p in payloads)
        assert reader.read() == []                                  # nothing there yet
        got: list[bytes] = []
        for cut in (2, 3, 40, 1000, 9000):                          # inside a header, a payload
            a.sendall(wire[:cut])
            wire = wire[cut:]
            got += [bytes(p) for p in reader.read() or []]
        a.sendall(wire)
        while len(got) < len(payloads):
            got += [bytes(p) for p in reader.read() or []]
        assert got == payloads
        one = pickle.dumps("single")
        a.sendall(struct.pack("!i", len(one)) + one)                # the common case
        assert [bytes(p) for p in reader.read() or []] == [one]
        assert os.get_blocking(b.fileno())                          # the writer's side blocks
        a.close()
        assert reader.read() is None                                # end of file
    finally:
        reader.close()
        b.close()


def test_the_core_process_is_launched_once_however_often_asked():
    """`serve` launches the core before it imports its HTTP stack; uvicorn's start-up then
    calls `start`, which must not start a second process."""
    class Counting(_NoProcess):
        starts = 0

        def start(self) -> None:
            Counting.starts += 1

    async def scenario() -> None:
        engine = AsyncEngine(EngineArgs())
        engine.process = Counting()                        # type: ignore[assignment]
        engine.launch()
        engine.launch()
        engine.start()
        engine.shutdown()
    asyncio.run(scenario())
    assert Counting.starts == 1


def test_serve_stops_a_launched_core_when_the_http_side_fails(monkeypatch):
    """A port taken between the check and uvicorn's bind: the core already loading must be
    stopped, or the API process would wait on its non-daemon child forever."""
    from kvrelay.server import http_server, launch
    stopped: list[bool] = []

    class Engine(AsyncEngine):
        def launch(self) -> None:
            self.launched = True

        def shutdown(self, timeout_s: float = 10.0) -> None:
            stopped.append(self.launched)

    def fails(*args: object) -> int:
        raise OSError("address already in use")
    monkeypatch.setattr(launch, "AsyncEngine", Engine)
    monkeypatch.setattr(http_server, "serve_http", fails)
    config = type("C", (), {"args": EngineArgs()})()
    with pytest.raises(OSError, match="already in use"):
        launch.serve(config, None)                         # type: ignore[arg-type]
    assert stopped == [True]
