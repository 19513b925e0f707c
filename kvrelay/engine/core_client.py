"""The API side of one engine core, whatever carries its messages: `CoreClient`.

It owns one inbox per in-flight request, the deltas accumulated into outputs, the
answers to explicit frees and the core's latest stats; `generate` yields accumulated
`RequestOutput`s as deltas arrive. Subclasses carry the messages: `AsyncEngine`
(`engine/async_client.py`: the engine-core process on this machine and its pipe) and
`dp_remote.RemoteReplica` (a core on a headless node, reached over TCP).

Request ids: the engine's id of a request is the caller's id plus a random suffix,
so requests that arrive with the same client id (a gateway retrying with one
X-Request-Id) never meet in the engine; callers keep using their own id.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.engine.client import (
    EngineDeadError,
    EngineError,
    KVHoldRefused,
    KVParamsRefused,
    KVTransferFailed,
    RequestFailed,
)
from kvrelay.engine.core_proc import freeze_startup_objects
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

