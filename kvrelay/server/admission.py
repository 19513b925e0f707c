"""Bounded admission: how much work one server accepts before it says "busy".

Two bounds, both answered at the door before the engine sees anything:

- per request, `--max-seqs-per-request` (default 256): a completion's prompts × n (every
  prompt and every one of its n choices is a sequence the scheduler runs). Over it: 400
  with an OpenAI error body naming `n` or `prompt`. OpenAI caps n at 128 (so does the
  request model); the product caps the batch, which n alone does not.
- per server, `--max-queued-requests` (SGLang's name, default 1024): the sequences that
  may wait beyond the ones the engine runs at once (`--max-num-seqs` × data-parallel
  replicas). A request that would take more is refused with 503, `Retry-After` and an
  OpenAI error body; nothing is queued and nothing of it reaches the engine, so the
  requests already admitted lose nothing. An idle server takes any request that passed
  the per-request bound (else a large request could never run).

The count is the API process's own: a sequence is in flight from the moment its request
is admitted until its output stream ends — finished, failed, aborted or never started
(then when the stream object is dropped) — so a burst of requests is bounded at once,
not one engine step later as the engine's own waiting count would be. `kvrelay proxy`
retries a prefill's 503 with Retry-After at the next prefill (`--prefill-busy-retry`).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay.engine.client import EngineClient
from kvrelay.engine.messages import EngineInfo, EngineStats
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.protocol import OpenAIError

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_SEQS_PER_REQUEST = 256
# the queue drains as running sequences finish (tens of ms to seconds a sequence here)
QUEUE_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class AdmissionLimits:
    running: int                                   # sequences the engine runs at once
    max_queued: int = DEFAULT_MAX_QUEUED_REQUESTS  # sequences that may wait beyond them
    max_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise ValueError(f"--max-queued-requests must be ≥ 0, got {self.max_queued}")
        if self.max_per_request < 1:
            raise ValueError(f"--max-seqs-per-request must be ≥ 1, got {self.max_per_request}")

    @property
    def capacity(self) -> int:
        return self.running + self.max_queued


class QueueFull(OpenAIError):
    """503 with Retry-After: the server's queue has no room for this request (busy, not
    broken; `kvrelay proxy` tries the next prefill)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, "ServiceUnavailableError")
        self.headers = {"Retry-After": str(QUEUE_RETRY_AFTER_S)}


class _Release:
    """Gives a request's sequences back exactly once (its stream's end, or its GC)."""

    def __init__(self, admission: Admission, sequences: int) -> None:
        self.admission, self.sequences = admission, sequences

    def __call__(self) -> None:
        if self.sequences:
            self.admission.in_flight -= self.sequences
            self.sequences = 0


class Admission:
    """The server's count of sequences in flight, and the two bounds on it."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.in_flight = 0
        self.refused = 0                          # requests answered 503 (queue full)

    @property
    def queued(self) -> int:
        """Sequences beyond those the engine can run at once: at least its waiting ones."""
        return max(0, self.in_flight - self.limits.running)

    def check_size(self, prompts: int, n: int) -> None:
        """400 naming the field when one request asks for more than --max-seqs-per-request."""
        cap = self.limits.max_per_request
        if n > cap:
            raise OpenAIError(f"n={n} exceeds this server's --max-seqs-per-request {cap}",
                              param="n")
        if prompts * n > cap:
            raise OpenAIError(f"{prompts} prompts × n={n} = {prompts * n} sequences exceed this "
                              f"server's --max-seqs-per-request {cap}; send fewer prompts per "
                              "request", param="prompt")

    def admit(self, sequences: int) -> None:
        """Count `sequences` in, or QueueFull when the queue has no room for them."""
        if self.in_flight and self.in_flight + sequences > self.limits.capacity:
            self.refused += 1
            raise QueueFull(
                f"the server is busy: {self.queued} sequences are queued beyond the "
                f"{self.limits.running} it runs at once (--max-queued-requests "
                f"{self.limits.max_queued}); retry after {QUEUE_RETRY_AFTER_S} s")
        self.in_flight += sequences

    def track(self, stream: AsyncGenerator[RequestOutput, None],
              sequences: int) -> AsyncGenerator[RequestOutput, None]:
        """`stream`, giving its sequences back when it ends or, if it never starts, when it
        is dropped (an async generator that never ran has no `finally` to run)."""
        release = _Release(self, sequences)
        tracked = _tracked(stream, release)
        weakref.finalize(tracked, release)
        return tracked


async def _tracked(stream: AsyncGenerator[RequestOutput, None],
                   release: _Release) -> AsyncGenerator[RequestOutput, None]:
    try:
        async for out in stream:
            yield out
    finally:
        try:
            await stream.aclose()                 # the engine stream's abort, now
        finally:
            release()


class AdmittedEngine:
    """An EngineClient that admits every `generate` through `Admission` first, so every
    endpoint (completions, chat, responses) is bounded by the same count. A batch of
    prompts is admitted whole (`batch`) before its first stream is made."""

    def __init__(self, engine: EngineClient, admission: Admission) -> None:
        self.engine, self.admission = engine, admission
        self.ready = engine.ready
        self._prepaid = 0

    @property
    def dead(self) -> str | None:
        return self.engine.dead

    @property
    def info(self) -> EngineInfo | None:
        return self.engine.info

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def streams(self) -> Mapping[str, Any]:
        return self.engine.streams

    def start(self) -> None:
        self.engine.start()

    async def wait_ready(self, timeout_s: float | None) -> None:
        await self.engine.wait_ready(timeout_s)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def check_stalled(self) -> None:
        self.engine.check_stalled()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def free_remote(self, request_id: str, capability: str) -> bool:
        return await self.engine.free_remote(request_id, capability)

    @contextlib.contextmanager
    def batch(self, prompts: int, n: int) -> Iterator[None]:
        """Admit a request's prompts × n sequences at once (400 / 503 before any stream);
        the `generate` calls inside take them; whatever is left unused goes back."""
        self.admission.check_size(prompts, n)
        self.admission.admit(prompts * n)
        self._prepaid += prompts * n
        try:
            yield
        finally:
            self.admission.in_flight -= self._prepaid
            self._prepaid = 0

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 kv_transfer_params: dict | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Raises at once (400 / 503) when the request may not be admitted."""
        n = params.n
        if self._prepaid >= n:
            self._prepaid -= n                    # admitted with its batch
        else:
            self.admission.check_size(1, n)
            self.admission.admit(n)
        return self.admission.track(
            self.engine.generate(request_id, prompt, params, kv_transfer_params), n)
