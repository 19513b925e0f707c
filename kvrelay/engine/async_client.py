"""The API server's handle on the engine-core process: `AsyncEngine`, an `EngineClient`.

`CoreClient` owns the API side of one engine core, whatever carries its messages: one
asyncio queue per in-flight request, the deltas accumulated into outputs, the answers
to explicit frees, the core's latest stats. `generate` yields accumulated
`RequestOutput`s as deltas arrive. `AsyncEngine` adds the engine-core process on this
machine and the pipe to it (the event loop reads the pipe itself: `add_reader`, one
wake-up per engine step); `dp_remote.RemoteReplica` adds a core on a headless node,
reached over TCP.

Request ids: the engine's id of a request is the caller's id plus a random suffix,
so requests that arrive with the same client id (a gateway retrying with one
X-Request-Id) never meet in the engine; callers keep using their own id.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.config import EngineArgs
from kvrelay.engine.client import (
    EngineDeadError,
    EngineError,
    KVHoldRefused,
    KVParamsRefused,
    KVTransferFailed,
    RequestFailed,
)
from kvrelay.engine.core_proc import freeze_startup_objects, run_engine_core
from kvrelay.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineStats,
    Fatal,
    Freed,
    FreeRemote,
    FromEngine,
    Ready,
    RequestRefused,
    Shutdown,
    StepOutputs,
    ToEngine,
)
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# the engine's error_status → what `generate` raises (anything else: a failed transfer)
_FAILURES: dict[int, type[RuntimeError]] = {400: KVParamsRefused, 500: RequestFailed,
                                             503: KVHoldRefused}
FREE_TIMEOUT_S = 30.0   # an explicit free waits at most this for the engine's answer


class Waker(Protocol):
    """Replicas in lockstep (`engine/lockstep.py`): after an add, every one gets a wake."""

    def wake_all(self) -> None: ...


class _Inbox:
    """What the core sent for one request, for its one consumer (`generate`): a deque, and a
    future only while the consumer waits. An asyncio.Queue costs ~3x as much per item
    (getter bookkeeping, emptiness checks, a wake-up callback), once per token and stream."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():      # done: its consumer was cancelled
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


@dataclass
class _Stream:
    queue: _Inbox | asyncio.Queue = field(default_factory=_Inbox)
    accumulated: RequestOutput | None = None


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Own copies of the per-step fields (deltas, finish reasons); the cumulative token
    and logprob lists are shared and only final outputs should read them. Built directly
    (once per token and stream: `dataclasses.replace` costs ~4x as much)."""
    return RequestOutput(
        out.request_id, out.prompt, out.prompt_token_ids,
        [CompletionOutput(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason,
                          o.logprobs, o.delta_text, o.delta_token_ids, o.delta_logprobs)
         for o in out.outputs],
        out.prompt_logprobs, out.num_cached_tokens, out.finished, out.kv_transfer_params,
        out.error, out.error_status)


class CoreClient:
    """The API side of one engine core; subclasses carry the messages (`_deliver`) and
    hand the core's messages to `receive` (from any thread)."""

    def __init__(self, step_timeout_s: float | None = None) -> None:
        self.step_timeout_s = step_timeout_s
        self.streams: dict[str, _Stream] = {}
        self.stats = EngineStats()                 # the core's latest snapshot
        self.info: EngineInfo | None = None        # what the core resolved at start-up
        self.ready = asyncio.Event()
        self.dead: str | None = None
        self.group: Waker | None = None            # lockstep: the DataParallelEngine
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_step = time.monotonic()          # when the core last reported a step
        self._stopping = False                     # shutdown() asked the core to exit
        self._frees: dict[int, asyncio.Future] = {}   # explicit frees awaiting the core's answer
        self._free_tokens = itertools.count()

    # -- what a subclass provides -----------------------------------------------------------
    def _deliver(self, message: ToEngine) -> None:
        """Carry one message to the core (OSError or EngineDeadError when it cannot)."""
        raise NotImplementedError

    def _exit_was_asked(self) -> bool:
        """Was the core's end (its `Fatal`) an asked-for exit rather than a crash?"""
        return self._stopping

    def _exit_detail(self) -> str:
        """What the log line of a crashed core adds (e.g. the exit code)."""
        return ""

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        freeze_startup_objects()              # the API process's own start-up objects

    async def wait_ready(self, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the engine was not ready within {timeout_s:.0f}s") from None
        if self.dead:
            raise EngineDeadError(self.dead)

    def shutdown(self) -> None:
        raise NotImplementedError

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        if self.dead:
            raise EngineDeadError(self.dead)
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if not self.streams:
            self.last_step = time.monotonic()        # the engine was idle until now
        stream = _Stream()
        self.streams[request_id] = stream
        finished = False
        try:
            self._send(AddRequest(request_id, prompt, params, kv_transfer_params))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # a snapshot: consumers may read it after the next delta has arrived
                out = _snapshot(self._accumulate(stream, item))
                finished = out.finished
                if out.error:
                    raise _FAILURES.get(out.error_status, KVTransferFailed)(out.error)
                yield out
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished and not self.dead:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._send(AbortRequests([request_id]))
        except (OSError, EngineDeadError):
            pass

    async def free_remote(self, request_id: str, capability: str) -> bool:
        """Free the blocks held for a decode under `request_id`, if `capability` is the
        one it was held with; whether anything was freed (the core answers `Freed`)."""
        token = next(self._free_tokens)
        answer = asyncio.get_running_loop().create_future()
        self._frees[token] = answer
        try:
            self._send(FreeRemote(request_id, capability, token))
            return bool(await asyncio.wait_for(answer, FREE_TIMEOUT_S))
        finally:
            self._frees.pop(token, None)

    @staticmethod
    def _accumulate(stream: _Stream, delta: RequestOutput) -> RequestOutput:
        acc = stream.accumulated
        if acc is None:
            stream.accumulated = acc = delta
            for o in acc.outputs:
                o.text, o.token_ids = o.delta_text, list(o.delta_token_ids)
                o.logprobs = list(o.delta_logprobs) if o.delta_logprobs is not None else None
            return acc
        for o, d in zip(acc.outputs, delta.outputs):
            o.text += d.delta_text
            o.token_ids.extend(d.delta_token_ids)
            if d.delta_logprobs is not None:
                o.logprobs = (o.logprobs or []) + list(d.delta_logprobs)
            o.delta_text, o.delta_token_ids = d.delta_text, d.delta_token_ids
            o.delta_logprobs = d.delta_logprobs
            o.finish_reason, o.stop_reason = d.finish_reason, d.stop_reason
        acc.finished = delta.finished
        acc.num_cached_tokens = delta.num_cached_tokens
        acc.kv_transfer_params = delta.kv_transfer_params or acc.kv_transfer_params
        acc.error, acc.error_status = delta.error, delta.error_status
        if delta.prompt_logprobs is not None:
            acc.prompt_logprobs = delta.prompt_logprobs
        return acc

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, message: ToEngine) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        self._deliver(message)
        if isinstance(message, AddRequest) and self.group is not None:
            self.group.wake_all()                  # lockstep: every replica learns of the add

    def receive(self, message: FromEngine) -> bool:
        """A message from the core, from any thread: handled in the event loop. False
        when there is no event loop (not started, or closed: the server is gone)."""
        if self._loop is None:
            return False
        try:
            self._loop.call_soon_threadsafe(self._dispatch, message)
        except RuntimeError:                       # the event loop closed
            return False
        return True

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, Ready):
            self.info, self.stats = message.info, message.stats
            self.ready.set()
        elif isinstance(message, StepOutputs):
            self.stats = message.stats
            self.last_step = time.monotonic()
            for out in message.outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.queue.put_nowait(out)
        elif isinstance(message, Freed):
            answer = self._frees.get(message.token)
            if answer is not None and not answer.done():
                answer.set_result(message.freed)
        elif isinstance(message, RequestRefused):
            stream = self.streams.get(message.request_id)
            if stream is not None:
                error = (EngineError(message.message, message.param) if message.status < 500
                         else RequestFailed(message.message))
                stream.queue.put_nowait(error)
        elif isinstance(message, Fatal):
            if self.dead is None:
                self.dead = message.reason
                if self._exit_was_asked():
                    logger.info("engine core stopped")
                else:
                    logger.error("engine core failed: %s%s", message.reason, self._exit_detail())
            for stream in self.streams.values():
                stream.queue.put_nowait(EngineDeadError(self.dead))
            for answer in self._frees.values():
                if not answer.done():
                    answer.set_exception(EngineDeadError(self.dead))
            self.ready.set()

    def check_stalled(self) -> None:
        """Fail in-flight requests when the engine reported no step for longer than the
        step timeout (a hung or pathologically slow step)."""
        if not self.step_timeout_s or not self.streams:
            return
        if time.monotonic() - self.last_step > self.step_timeout_s:
            error = EngineDeadError(
                f"no engine step completed within {self.step_timeout_s:.0f}s; raise "
                f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (or KVRELAY_EXECUTE_MODEL_TIMEOUT_SECONDS)")
            for stream in self.streams.values():
                stream.queue.put_nowait(error)
            self.last_step = time.monotonic()


class FrameReader:
    """`multiprocessing.Connection`'s framing (a 4-byte big-endian length, or -1 and an
    8-byte one, then the payload), read without blocking from a socket whose descriptor
    stays blocking for the writer's sake: each `read` takes what is there in one recv(2)
    (MSG_DONTWAIT) and returns the payloads completed so far (None at end of file); a
    partial message waits for the next call."""

    # a larger buffer costs more than it saves: recv(1 MiB) of a 300-byte message took
    # 54 µs (the buffer is mapped and unmapped each call), recv(64 KiB) 7 µs; a bigger
    # message takes a few wake-ups (the loop polls level-triggered)
    CHUNK = 1 << 16

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=os.dup(fd))
        self.buffer = bytearray()

    def close(self) -> None:
        self.sock.close()

    def read(self) -> list[bytes | memoryview] | None:
        try:
            data = self.sock.recv(self.CHUNK, socket.MSG_DONTWAIT)
        except BlockingIOError:                  # woken spuriously: nothing there yet
            return []
        if not data:
            return None
        buf = self.buffer
        if not buf and len(data) >= 4:           # the common case: one whole message
            size = _HEADER.unpack_from(data)[0]
            if size >= 0 and len(data) == 4 + size:
                return [memoryview(data)[4:]]
        buf += data
        payloads: list[bytes | memoryview] = []
        start = 0
        while len(buf) - start >= 4:
            size, head = _HEADER.unpack_from(buf, start)[0], 4
            if size == -1:                       # a message over 2 GiB
                if len(buf) - start < 12:
                    break
                size, head = _LONG_HEADER.unpack_from(buf, start + 4)[0], 12
            if len(buf) - start < head + size:
                break
            payloads.append(bytes(buf[start + head:start + head + size]))
            start += head + size
        del buf[:start]
        return payloads


_HEADER, _LONG_HEADER = struct.Struct("!i"), struct.Struct("!Q")


class AsyncEngine(CoreClient):
    """An `EngineClient` for one engine-core process on this machine."""

    def __init__(self, args: EngineArgs, step_timeout_s: float | None = None) -> None:
        super().__init__(step_timeout_s)
        self.args = args
        self._send_lock = threading.Lock()
        self._frames: FrameReader | None = None
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=run_engine_core,
                                   args=(args, child, logging.getLogger().level),
                                   name="kvrelay-engine-core", daemon=False)

    def start(self) -> None:
        super().start()
        self.process.start()
        assert self._loop is not None, "CoreClient.start set the running loop"
        fd = self._conn.fileno()
        self._frames = FrameReader(fd)
        self._loop.add_reader(fd, self._readable)
        # uvloop makes a descriptor it watches non-blocking; `_deliver`'s writes must block
        # (a burst of requests may outgrow the socket's buffer), the reader never does
        os.set_blocking(fd, True)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self.process.is_alive():
            try:
                self._send(Shutdown())
            except (OSError, EngineDeadError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()

    def _deliver(self, message: ToEngine) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _readable(self) -> None:
        """The pipe has data: read what is there and handle every whole message here, in
        the event loop.

        A reader thread would cost each step a thread wake-up, a GIL hand-over and a wake of
        the loop through its self-pipe: at one stream that was a third of the API process's
        CPU per token, and on shared cores CPU taken from the engine's compute threads. One
        recv(2) per wake-up (Connection.recv makes two reads, and the descriptor's blocking
        mode had to be checked first); the read never blocks, so a message larger than the
        socket's buffer arrives over several wake-ups without holding up the loop."""
        assert self._loop is not None and self._frames is not None
        try:
            messages = self._frames.read()
        except OSError:
            messages = None
        for payload in messages or ():
            message: FromEngine = pickle.loads(payload)
            if isinstance(message, Fatal):
                self._stop_reading()
                self._dispatch(message)
                return
            self._dispatch(message)
        if messages is None:                      # end of file: the core is gone
            self._stop_reading()
            self._dispatch(Fatal("the engine process exited"))

    def _stop_reading(self) -> None:
        assert self._loop is not None and self._frames is not None
        self._loop.remove_reader(self._conn.fileno())
        self._frames.close()

    def _exit_was_asked(self) -> bool:
        return self._stopping or self._terminated()

    def _exit_detail(self) -> str:
        return f" (exit code {self.process.exitcode})"

    def _terminated(self) -> bool:
        """Did the core exit on SIGTERM/SIGINT (e.g. sent to the whole process group by a
        supervisor stopping the server)? Called only once its pipe has closed."""
        self.process.join(1.0)
        return self.process.exitcode in (-signal.SIGTERM, -signal.SIGINT)
