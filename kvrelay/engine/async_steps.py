"""Async scheduling (`--async-scheduling`): plan step N+1 while step N computes.

Owner of: the forward thread and the steps handed to it. The engine keeps every
request's state; this only changes *when* each part of a step runs:

    engine (main) thread                          forward thread
    ───────────────────────────────────────────   ──────────────────────────────────
    plan N+1 ahead of N, hand it over             forward N
    wait for N to land ◀───────────────────────── draw N's tokens (sampler), hand back
    apply + update N, prepare N+1's sampling ───▶ fill N+1's pending tokens, forward N+1
      (N+1 may draw from here on)                   ... waits until N+1 may draw
    detokenize, outputs N (returned and sent)
    plan N+2 ahead of N+1, hand it over ...

The forward thread goes from one step's tokens straight into the next step's forward:
nothing on that path waits for the engine thread to wake up, as long as the engine
thread has planned the next step (and applied the last one) within a forward's time.
Scheduling, input preparation, the scheduler's update, detokenizing and the engine→API
message all run during a forward. Request state is written on the engine thread only:
the forward thread reads a `StepInput` (plain lists) and, when drawing, the requests a
step samples — after the engine thread has applied the previous step and prepared this
one's sampling (`_Step.may_draw`), and before it applies this one.

What it costs: a request that step N ends by EOS, a stop id, a stop string or its
grammar has already been planned into N+1; that row is computed and dropped (one
wasted row per finished request; a request ending by length is never planned past its
last token). A request freed while its row still computes (finished, aborted) had
blocks that later steps may reuse: those steps' forwards run after this one on the
same thread, so their writes come after its stray write; the rows it writes are never
in the prefix cache (only fully computed blocks are). A forward that raises is re-run
on the engine thread, chunk by chunk (`step_io.forward`), before the forward thread
goes on.

Greedy outputs are the tokens of synchronous scheduling (tests/engine/
test_async_scheduling.py compares every output field); seeded sampling too, since a
request's draws come from its own generator.

Not combined with disaggregated KV transfer or experts across data-parallel replicas
(`EngineArgs` refuses those): both coordinate each step with other processes.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvrelay.engine import step_io
from kvrelay.engine.step_io import StepPlan

if TYPE_CHECKING:
    from kvrelay.engine.executor import Executor
    from kvrelay.engine.output_processor import OutputProcessor
    from kvrelay.engine.outputs import RequestOutput
    from kvrelay.engine.request import Request
    from kvrelay.engine.runner import StepInput
    from kvrelay.engine.sampler import Sampler

logger = logging.getLogger(__name__)


class PipelinedEngine(Protocol):
    """The parts of `core.LLMEngine` that `AsyncSteps` runs, named here because core.py
    imports this module: the import points one way."""

    @property
    def executor(self) -> Executor: ...
    @property
    def sampler(self) -> Sampler: ...
    @property
    def output(self) -> OutputProcessor: ...

    def plan_step(self, ahead: StepPlan | None = None) -> StepPlan: ...
    def prepare_sampling(self, plan: StepPlan) -> None: ...
    def forward(self, plan: StepPlan, step: StepInput) -> torch.Tensor: ...
    def sample(self, plan: StepPlan, logits: torch.Tensor) -> dict[str, list[int]]: ...
    def update_step(self, plan: StepPlan, sampled: dict[str, list[int]]) -> None: ...
    def step_outputs(self, plan: StepPlan) -> list[RequestOutput]: ...
    def _fail_request(self, req: Request, error: BaseException, where: str,
                      message: str | None = None) -> None: ...


@dataclass(eq=False)
class _Step:
    plan: StepPlan
    may_draw: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Landed:
    step: _Step
    drawn: step_io.Draw | None = None
    error: Exception | None = None        # the forward raised (re-run on the engine thread)
    fatal: BaseException | None = None    # drawing raised outside any one request


class AsyncSteps:
    """`LLMEngine.step` with async scheduling: each call hands the next step to the
    forward thread and returns the outputs of the step that landed (none on the call
    that starts from idle). The engine counts a step in flight as unfinished work."""

    def __init__(self, engine: PipelinedEngine) -> None:
        self.engine = engine
        self._steps: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
        self._landed: queue.SimpleQueue[_Landed] = queue.SimpleQueue()
        self._resume = threading.Event()     # after a failed forward: the next step is filled
        self._flight: _Step | None = None    # handed over, not landed yet
        self._stopping = False
        self.num_dropped_rows = 0            # rows computed for requests finished meanwhile
        # torch's thread count is per calling thread: the forward thread's OpenMP team
        # gets the engine's
        self._thread = threading.Thread(target=self._run, args=(torch.get_num_threads(),),
                                        name="kvrelay-forward", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A step is computing: its outputs are still to come."""
        return self._flight is not None

    # -- the engine thread ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        e, prev = self.engine, self._flight
        plan = e.plan_step(ahead=prev.plan if prev is not None else None)
        nxt = _Step(plan) if plan.step is not None else None
        if nxt is not None:
            if prev is None:                 # from idle: it may draw once computed
                e.prepare_sampling(plan)
                nxt.may_draw.set()
            self._steps.put(nxt)
        self._flight = nxt
        if prev is None:
            return e.output.failed_outputs(plan.failed)
        landed = self._landed.get()
        assert landed.step is prev
        if landed.fatal is not None:
            raise landed.fatal
        if landed.error is not None:         # the forward raised: attribute it here
            sampled = self._recover(prev, nxt, landed.error)
        else:
            assert landed.drawn is not None
            sampled = step_io.apply(landed.drawn, e._fail_request)
        e.update_step(prev.plan, sampled)
        if nxt is not None:
            e.prepare_sampling(plan)         # after N's update: grammars saw N's tokens
            nxt.may_draw.set()
            completing = sum(1 for c in plan.out.chunks if c.completes)
            self.num_dropped_rows += completing - len(plan.sampling or ())
        return e.step_outputs(prev.plan) + e.output.failed_outputs(plan.failed)

    def _recover(self, prev: _Step, nxt: _Step | None,
                 error: Exception) -> dict[str, list[int]]:
        """The forward thread's forward of `prev` raised: re-run it here, chunk by chunk
        where the executor allows, so the failure is attributed (`step_io.forward`); fill
        the step handed over after it, and let the forward thread go on."""
        e = self.engine
        if not e.executor.can_rerun:
            raise error                      # TP ranks' collectives cannot be replayed
        plan = prev.plan
        assert plan.step is not None
        sampled = e.sample(plan, e.forward(plan, plan.step))
        if nxt is not None:
            assert nxt.plan.step is not None
            step_io.fill_pending(nxt.plan.out, nxt.plan.step, sampled)
        self._resume.set()
        return sampled

    def shutdown(self) -> None:
        """Stop the forward thread, wherever it waits (a step it computes is dropped)."""
        self._stopping = True
        self._steps.put(None)
        self._resume.set()
        self._thread.join(timeout=60)

    # -- the forward thread -----------------------------------------------------------------
    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        e = self.engine
        last: dict[str, list[int]] = {}      # the previous step's tokens, by request id
        while (step := self._steps.get()) is not None and not self._stopping:
            plan = step.plan
            assert plan.step is not None
            step_io.fill_pending(plan.out, plan.step, last)
            try:
                logits = e.executor.execute(plan.step)
            except Exception as error:  # noqa: BLE001 -- attributed on the engine thread
                logger.debug("forward failed on the forward thread (%s)", error)
                self._landed.put(_Landed(step, error=error))
                self._resume.wait()          # the engine thread re-runs it and fills the next
                self._resume.clear()
                if self._stopping:
                    return
                last = {}
                continue
            while not step.may_draw.wait(0.05):
                if self._stopping:           # the engine thread stopped (e.g. it failed)
                    return
            try:
                drawn = step_io.draw(plan.out, logits, e.sampler, plan.sampling)
            except BaseException as fatal:  # noqa: BLE001 -- the engine thread raises it
                self._landed.put(_Landed(step, fatal=fatal))
                return
            last = dict(drawn.tokens)
            self._landed.put(_Landed(step, drawn))
