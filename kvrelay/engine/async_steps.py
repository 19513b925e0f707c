"""Async scheduling (`--async-scheduling`): plan step N+1 while step N computes.

Owner of: the one step in flight and the thread its forward runs on. The engine keeps
every request's state; this only changes *when* each part of a step runs:

    main thread                                   forward thread
    ─────────────────────────────────────────     ─────────────────────
    plan N+1 (schedule ahead of N, step input)    forward N
    wait for N's logits ◀──────────────────────── (logits N)
    sample N ─▶ fill N+1's pending tokens ───────▶ forward N+1
    update N, detokenize, outputs N (returned)
    prepare N+1's sampling (grammar masks)
    [the caller sends N's outputs, reads its pipe]
    plan N+2 ...

So scheduling, input preparation, the scheduler's update, detokenizing and the
engine→API message of one step run while the model computes the next; the sampler
stays on the critical path (the next step's input is its token). Every request's
state is touched on the main thread only: the forward thread reads a `StepInput` (plain
lists, filled before it is handed over) and the model's own tensors.

What it costs: a request that step N ends by EOS, a stop id, a stop string or its
grammar has already been planned into N+1; that row is computed and dropped (one
wasted row per finished request; a request ending by length is never planned past its
last token). A request freed while its row still computes (finished, aborted) had
blocks that later steps may reuse: those steps' forwards run after this one on the
same thread, so their writes come after its stray write; the rows it writes are never
in the prefix cache (only fully computed blocks are).

Greedy outputs are the tokens of synchronous scheduling (the same steps in the same
order per request; tests/engine/test_async_scheduling.py compares them); seeded
sampling too, since a request's draws come from its own generator.

Not combined with disaggregated KV transfer or experts across data-parallel replicas
(`EngineArgs` refuses those): both coordinate each step with other processes.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvrelay.engine import step_io

if TYPE_CHECKING:
    from kvrelay.engine.core import LLMEngine, StepPlan
    from kvrelay.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _Flight:
    plan: StepPlan
    logits: Future[torch.Tensor]


class AsyncSteps:
    """`LLMEngine.step` with async scheduling: each call launches the next step's
    forward and returns the outputs of the step that just landed (none on the call that
    starts from idle). The engine counts a step in flight as unfinished work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        threads = torch.get_num_threads()
        # the forward's own OpenMP team: torch's thread count is per calling thread
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvrelay-forward",
                                          initializer=torch.set_num_threads,
                                          initargs=(threads,))
        self._flight: _Flight | None = None
        self.num_dropped_rows = 0         # rows computed for requests finished meanwhile

    @property
    def busy(self) -> bool:
        """A step is computing: its outputs are still to come."""
        return self._flight is not None

    def step(self) -> list[RequestOutput]:
        e, prev = self.engine, self._flight
        plan = e.plan_step(ahead=prev.plan if prev is not None else None)
        if prev is None:                       # from idle: nothing lands this call
            if plan.step is None:
                return e.output.failed_outputs(plan.failed)
            e.prepare_sampling(plan)
            self._launch(plan)
            return []
        self._flight = None
        sampled = e.sample(prev.plan, self._logits(prev))
        if plan.step is not None:
            step_io.fill_pending(plan.out, plan.step, sampled)
            self._launch(plan)
        outputs = e.finish_step(prev.plan, sampled)
        if plan.step is not None:
            e.prepare_sampling(plan)           # after N's update: grammars saw N's tokens
            completing = sum(1 for c in plan.out.chunks if c.completes)
            self.num_dropped_rows += completing - len(plan.sampling or ())
        return outputs + e.output.failed_outputs(plan.failed)

    def _launch(self, plan: StepPlan) -> None:
        step = plan.step
        assert step is not None
        self._flight = _Flight(plan, self._thread.submit(self.engine.executor.execute, step))

    def _logits(self, flight: _Flight) -> torch.Tensor:
        """The landed step's logits; a forward that raised is re-run here, chunk by chunk
        where the executor allows, so the failure is attributed (`step_io.forward`)."""
        try:
            return flight.logits.result()
        except Exception as error:  # noqa: BLE001 -- attributed below, or re-raised
            if not self.engine.executor.can_rerun:
                raise
            logger.debug("async forward failed (%s); re-running on the main thread", error)
            assert flight.plan.step is not None
            return self.engine.forward(flight.plan, flight.plan.step)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
