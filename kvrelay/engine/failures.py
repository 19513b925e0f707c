"""Failure isolation: one request must not take the engine down.

`LLMEngine.add_request` validates everything against the model (vocabulary, lengths,
logprobs) and adds all of a request's sequences or none. Inside a step, the phases that
depend on one request's own parameters — the forward when it runs in this process,
sampling (logits processors, logit_bias, top-k, logprobs), prompt logprobs, detokenising
and stop strings, output assembly — attribute a failure to the request that caused it
(`RequestFailures.fail`: its sequences are aborted, its blocks freed, its client gets an
error output with status 500) and the step goes on for the others. Scheduling and
KV-cache bookkeeping are shared state: an exception there, or a KV pool that fails its
integrity check after a request was failed, still ends the engine.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from kvrelay.engine.kv_transfer import KVTransferGlue
from kvrelay.engine.output_processor import OutputProcessor, error_output
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler
from kvrelay.kv_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)


class RequestFailures:
    """Owner of: the error outputs of the requests failed during the current step (the
    engine's owners do the failing: the output processor forgets the request, the
    scheduler aborts its sequences, the KV glue releases what it holds)."""

    def __init__(self, output: OutputProcessor, scheduler: Scheduler, transfer: KVTransferGlue,
                 kv: KVCacheManager, abort: Callable[[str], None]) -> None:
        self.output, self.scheduler, self.transfer, self.kv = output, scheduler, transfer, kv
        self.abort = abort                              # LLMEngine.abort_request
        self.pending: list[RequestOutput] = []

    def fail(self, req: Request, error: BaseException, where: str,
             message: str | None = None) -> None:
        """Fail the client request `req` belongs to (all of its n sequences): abort them,
        free their blocks, and queue an error output (`message`, else one naming `where`
        and `error`); the engine keeps serving the rest."""
        parent = self.output.parent_of(req.request_id)
        logger.error("request %s failed in %s: %s: %s", req.request_id, where,
                     type(error).__name__, error, exc_info=error)
        if parent is None:
            self.scheduler.abort(req.request_id)
            return
        self.abort(parent.request_id)
        for child in parent.children:
            self.transfer.release(child)             # finished prefill: its held blocks
        self.output.forget(parent)
        self.pending.append(error_output(parent, message or f"the request failed in {where}: "
                                                            f"{type(error).__name__}: {error}"))

    def fail_broken_grammars(self, finished: list[Request]) -> None:
        """A sequence whose grammar failed (a token it refused, a limit llguidance hit
        computing a mask: `GrammarMatcher.failed`) was stopped by the scheduler; its
        request ends with an error (500), never with text that breaks its constraint."""
        for req in finished:
            if (req.grammar is not None and req.grammar.failed is not None
                    and self.output.parent_of(req.request_id) is not None):
                reason = f"structured output failed: {req.grammar.failed}"
                self.fail(req, RuntimeError(reason), "structured output", reason)

    def take(self) -> list[RequestOutput]:
        """This step's failed requests' outputs. Failing them freed blocks mid-step: the
        KV pool must still be consistent, otherwise the failure was not theirs alone."""
        failures, self.pending = self.pending, []
        if failures:
            self.kv.check_integrity()
        return failures
