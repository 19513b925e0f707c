"""Background responses (`background: true`): run in the server, polled, cancelled, resumed.

    POST /v1/responses {background: true, store: true}
      → stored `queued` and answered at once; with `stream: true` the answer is the run's
        events, read from its event log as they come (a client that leaves stops reading,
        not the run)
    the run, a task on the event loop:
      first output from the engine   → stored `in_progress`
      the engine finished            → stored `completed` / `incomplete` (as a foreground
                                       response: responses.finish_response)
      the engine failed              → stored `failed` (`error`, the output so far)
      POST /v1/responses/{id}/cancel → the task is cancelled, which closes the engine request
                                       (abort: its KV blocks are freed) → stored `cancelled`
                                       (the output so far, its usage)
    GET /v1/responses/{id}                                 → the stored response
    GET /v1/responses/{id}?stream=true&starting_after=N    → the log's events after N

As OpenAI: background needs `store: true` (and the store on); cancelling a finished
background response returns it unchanged (cancel is idempotent), cancelling a foreground
one is a 400; only a response created with `stream: true` can be streamed again. A
streamed response's event log is bounded (`EVENT_LOG_MAX_BYTES`, the oldest events dropped
first) and kept after the run for resuming within `FINISHED_LOGS_MAX_BYTES` /
`FINISHED_LOGS_MAX` (oldest finished logs dropped first); logs live in memory, so after a
restart the response is still there (a SQLite store) but its events are not. A run the
server did not finish (it stopped) is stored `failed`.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import serving
from kvrelay.server.harmony_chat import HarmonyChat
from kvrelay.server.mcp.loop import McpLoop
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_output import Decoder, OutputBuilder
from kvrelay.server.response_request import Prepared, ResponsesRequest, output_messages
from kvrelay.server.response_store import ResponseStore, StoredResponse
from kvrelay.server.responses import finish_response, response_object, response_usage, sse_event

logger = logging.getLogger(__name__)

EVENT_LOG_MAX_BYTES = 8 << 20          # one response's events (~40k output tokens)
FINISHED_LOGS_MAX_BYTES = 64 << 20     # the logs of finished responses, kept for resuming
FINISHED_LOGS_MAX = 256
NOT_KEPT = {"code": "server_error",
            "message": "the response was larger than the responses store keeps "
                       "(KVRELAY_RESPONSES_STORE_MAX_ENTRY_BYTES)"}


def check_background(body: ResponsesRequest, store: ResponseStore) -> None:
    """400 for a background request the server cannot keep (OpenAI: store must be true)."""
    if not body.background:
        return
    if not store.enabled:
        raise OpenAIError("background responses need the responses store, which is off on "
                          "this server (VLLM_ENABLE_RESPONSES_API_STORE=0)", param="background")
    if body.store is not True:
        raise OpenAIError("background responses require store: true", param="store")


class EventLog:
    """The numbered SSE events of one streamed background response, for readers that
    (re)connect. At most `max_bytes`: past it the oldest events are dropped. Owner: the
    event loop (appends wake the readers)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes or EVENT_LOG_MAX_BYTES
        self.bytes = 0
        self.first = 0                  # the sequence number of events[0]
        self.events: deque[str] = deque()
        self.closed = False
        self._wake = asyncio.Event()

    @property
    def next(self) -> int:
        """The sequence number the next event gets."""
        return self.first + len(self.events)

    def append(self, payload: dict[str, Any]) -> None:
        text = sse_event(self.next, payload)
        self.events.append(text)
        self.bytes += len(text)
        while self.bytes > self.max_bytes and len(self.events) > 1:
            self.bytes -= len(self.events.popleft())
            self.first += 1
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def check(self, starting_after: int | None) -> None:
        """400 when the events after `starting_after` are no longer all kept."""
        if starting_after is not None and starting_after + 1 < self.first:
            raise OpenAIError(f"starting_after: the events up to {self.first - 1} are no "
                              f"longer kept (at most {self.max_bytes} bytes of events)",
                              param="starting_after")

    async def follow(self, starting_after: int | None) -> AsyncIterator[str]:
        """The events after `starting_after` (None: all), then each one as it comes, until
        the log is closed."""
        seq = 0 if starting_after is None else max(starting_after + 1, 0)
        while True:
            wake = self._wake
            while seq < self.next:
                if seq < self.first:           # this reader fell behind the bound
                    yield sse_event(seq, {"type": "error", "code": "events_dropped", "param": None,
                                       "message": f"the events up to {self.first - 1} are no "
                                                  "longer kept; GET the response instead"})
                    return
                yield self.events[seq - self.first]
                seq += 1
            if self.closed:
                return
            await wake.wait()


@dataclass
class _Run:
    """One background response while it runs."""
    prepared: Prepared
    log: EventLog | None                # streamed: its events
    timing: serving._Timing             # TTFT / ITL / e2e into the metrics
    task: asyncio.Task | None = None
    running: bool = False               # the task has begun (a cancel before: it never will)
    cancel_requested: bool = False
    started: bool = False               # the engine has answered: in progress
    tokens: int = 0                     # output tokens so far
    cached: int = 0                     # prompt tokens the prefix cache served

    @property
    def owner(self) -> str:
        return self.prepared.owner

    def emit(self, payloads: list[dict[str, Any]]) -> None:
        if self.log is not None:
            for payload in payloads:
                self.log.append(payload)


@dataclass
class _Logs:
    """The event logs of finished streamed responses, oldest first, bounded."""
    logs: OrderedDict[str, tuple[str, EventLog]] = field(default_factory=OrderedDict)
    bytes: int = 0

    def add(self, response_id: str, owner: str, log: EventLog) -> None:
        self.logs[response_id] = (owner, log)
        self.bytes += log.bytes
        while self.logs and (self.bytes > FINISHED_LOGS_MAX_BYTES
                             or len(self.logs) > FINISHED_LOGS_MAX):
            _, (_, old) = self.logs.popitem(last=False)
            self.bytes -= old.bytes

    def get(self, response_id: str, owner: str) -> EventLog | None:
        found = self.logs.get(response_id)
        return found[1] if found is not None and found[0] == owner else None

    def drop(self, response_id: str) -> None:
        found = self.logs.pop(response_id, None)
        if found is not None:
            self.bytes -= found[1].bytes


class BackgroundResponses:
    """Owner of this server's running background responses (their tasks) and of the event
    logs of streamed ones. Event loop only: no locks."""

    def __init__(self, state: serving.ServerState, store: ResponseStore) -> None:
        self.state, self.store = state, store
        self._runs: dict[str, _Run] = {}
        self._logs = _Logs()

    def __len__(self) -> int:
        return len(self._runs)

    def start(self, p: Prepared, generate: Callable[[], AsyncIterator[RequestOutput] | None]
              ) -> dict[str, Any]:
        """Store `p` as queued, then start it in the engine (`generate()`: a full queue is
        a 503 now, and nothing stays stored) and in a task; the queued response. A request
        with MCP tools (`p.mcp`) runs the tool loop (kvrelay/server/mcp/loop.py) in the task;
        its `generate()` is None when the loop makes its first engine request itself."""
        queued = response_object(p, "queued", [], None, True)
        if not self.store.put(StoredResponse(queued, p.messages, p.owner)):
            raise OpenAIError("the request is larger than the responses store keeps, so it "
                              "cannot run in the background", param="background")
        try:
            gen = generate()
        except BaseException:
            self.store.delete(p.response_id, p.owner)
            raise
        run = _Run(p, EventLog() if p.body.stream else None,
                   serving._Timing(self.state.metrics))
        run.emit([{"type": "response.created", "response": queued},
                  {"type": "response.queued", "response": queued}])
        self._runs[p.response_id] = run
        drive = self._drive(run, gen) if p.mcp is None else self._drive_loop(run, gen)
        run.task = asyncio.get_running_loop().create_task(drive,
                                                          name=f"background {p.response_id}")
        return queued

    async def cancel(self, response_id: str, owner: str) -> None:
        """Cancel the run of `response_id` if it is this owner's and still running; returns
        once its `cancelled` response is stored."""
        run = self._runs.get(response_id)
        if run is None or run.owner != owner or run.task is None:
            return
        run.cancel_requested = True
        if run.running:                 # else it sees the request when it begins
            run.task.cancel()
        await asyncio.wait([run.task])

    def events(self, response_id: str, owner: str,
               starting_after: int | None) -> AsyncIterator[str] | None:
        """The events of a streamed background response after `starting_after`; None when
        none are kept for it (not streamed, unknown, another owner's, or dropped)."""
        run = self._runs.get(response_id)
        log = run.log if run is not None and run.owner == owner else \
            self._logs.get(response_id, owner)
        if log is None:
            return None
        log.check(starting_after)
        return log.follow(starting_after)

    def forget(self, response_id: str, owner: str) -> None:
        """A deleted response: its finished log goes too."""
        if self._logs.get(response_id, owner) is not None:
            self._logs.drop(response_id)

    # -- the run

    async def _drive(self, run: _Run, gen: AsyncIterator[RequestOutput] | None) -> None:
        assert gen is not None          # only the MCP loop starts without one
        run.running = True
        p = run.prepared
        decoder = Decoder(isinstance(self.state.chat, HarmonyChat), OutputBuilder(p.tools))
        try:
            if run.cancel_requested:            # cancelled before the task began
                raise asyncio.CancelledError
            final = await self._generate(run, gen, decoder)
            response = finish_response(self.state, self.store, p, decoder, final)
            if response["store"] is False:      # too large to keep: say so where it is polled
                self._keep(p, {**response, "output": [], "status": "failed", "error": NOT_KEPT},
                           p.messages)
            run.emit(decoder.builder.take_events())
            kind = "completed" if response["status"] == "completed" else "incomplete"
            run.emit([{"type": f"response.{kind}", "response": response}])
        except asyncio.CancelledError:
            status = "cancelled" if run.cancel_requested else "failed"
            error = None if run.cancel_requested else {
                "code": "server_error", "message": "the server stopped before this background "
                                                   "response finished"}
            self._stop(run, decoder, status, error)
            raise
        except Exception as e:                  # the engine's errors, and anything unexpected
            if not isinstance(e, (OpenAIError, RuntimeError)):
                logger.error("background response %s failed", p.response_id, exc_info=e)
            response = self._stop(run, decoder, "failed",
                                  {"code": "server_error", "message": str(e) or type(e).__name__})
            run.emit([{"type": "response.failed", "response": response}])
        finally:
            self._ended(run)

    async def _drive_loop(self, run: _Run, gen: AsyncIterator[RequestOutput] | None) -> None:
        """A background response with MCP tools: the tool loop in this task, its events
        into the log. Cancelled mid-loop — generating, or while a call is in flight (the MCP
        session is closed, the call abandoned) — it is stored `cancelled` with the items so
        far, those not finished `incomplete`."""
        run.running = True
        p = run.prepared
        loop = McpLoop(self.state, self.store, p)
        try:
            if run.cancel_requested:            # cancelled before the task began
                raise asyncio.CancelledError
            async for event in loop.run(gen):
                if not run.started:
                    self._started(run)
                run.emit([event])
            response, messages = loop.finish(True)
            self._keep(p, response, messages)
            kind = "completed" if response["status"] == "completed" else "incomplete"
            run.emit([{"type": f"response.{kind}", "response": response}])
        except asyncio.CancelledError:
            error = None if run.cancel_requested else {
                "code": "server_error", "message": "the server stopped before this background "
                                                   "response finished"}
            run.emit(loop.stop())
            self._keep(p, *loop.finish(True, "cancelled" if run.cancel_requested else "failed",
                                       error))
            raise
        except Exception as e:                  # the engine's errors, a later round's 503
            if not isinstance(e, (OpenAIError, RuntimeError)):
                logger.error("background response %s failed", p.response_id, exc_info=e)
            run.emit(loop.stop())
            response, messages = loop.finish(True, "failed", {
                "code": "server_error", "message": str(e) or type(e).__name__})
            self._keep(p, response, messages)
            run.emit([{"type": "response.failed", "response": response}])
        finally:
            self._ended(run)

    async def _generate(self, run: _Run, gen: AsyncIterator[RequestOutput],
                        decoder: Decoder) -> RequestOutput:
        """The engine's outputs into the decoder (and the log) until the final one."""
        p = run.prepared
        final = None
        async for _, out in serving._merge([gen]):
            if not run.started:
                self._started(run)
            o = out.outputs[0]
            run.tokens += len(o.delta_token_ids)
            run.cached = out.num_cached_tokens
            run.timing.tokens_arrived(len(o.delta_token_ids))
            decoder.feed(o.delta_token_ids, o.delta_text)
            run.emit(decoder.builder.take_events())
            if out.finished:
                final = out
                run.timing.finished(len(p.rendered.prompt_ids), [o.finish_reason])
        if final is None:
            raise RuntimeError("the engine ended the request without a final output")
        return final

    def _started(self, run: _Run) -> None:
        """The first output: the response is in progress."""
        run.started = True
        p = run.prepared
        response = response_object(p, "in_progress", [], None, True)
        self._keep(p, response, p.messages)
        run.emit([{"type": "response.in_progress", "response": response}])

    def _stop(self, run: _Run, decoder: Decoder, status: str,
              error: dict[str, Any] | None) -> dict[str, Any]:
        """A run that ends before the engine finished: its items closed as incomplete, the
        response stored with the output and usage so far."""
        p = run.prepared
        decoder.close()
        output = decoder.builder.finish(True)
        run.emit(decoder.builder.take_events())
        usage = response_usage(p, run.tokens, decoder.reasoning_tokens, run.cached)
        response = {**response_object(p, status, output, usage, True), "error": error}
        self._keep(p, response, p.messages + output_messages(output))
        return response

    def _keep(self, p: Prepared, response: dict[str, Any],
              messages: list[dict[str, Any]]) -> None:
        if not self.store.put(StoredResponse(response, messages, p.owner)):
            self.store.put(StoredResponse({**response, "output": [], "status": "failed",
                                           "error": NOT_KEPT}, [], p.owner))

    def _ended(self, run: _Run) -> None:
        p = run.prepared
        self._runs.pop(p.response_id, None)
        if run.log is not None:
            run.log.close()
            self._logs.add(p.response_id, p.owner, run.log)
