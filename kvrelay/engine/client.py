"""What the API server codes against: an `EngineClient`, and the errors it raises.

Two implementations: `AsyncEngine` (`engine/async_client.py`: one engine-core process)
and `DataParallelEngine` (`engine/data_parallel.py`: N replicas, some possibly on
headless nodes). The server never learns which one it has.

Errors `generate` raises, and the HTTP status each maps to:

    EngineError       400  the engine refused the request (`param` names the field)
    KVParamsRefused   400  its kv_transfer_params name KV it may not load (an EngineError)
    RequestFailed     500  it failed inside the engine, which went on serving the others
    KVTransferFailed  502  its KV transfer failed (policy "fail")
    KVHoldRefused     503  a prefill could not hold its KV for a decode (busy, retry)
    EngineDeadError   503  the engine process failed; every in-flight request fails
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Protocol, runtime_checkable

from kvrelay.engine.messages import EngineInfo, EngineStats
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine refused a request (a client mistake) — maps to HTTP 400; `param`
    names the request field when the engine knows it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class KVParamsRefused(EngineError):
    """A decode refused to load the KV a request's kv_transfer_params name after admitting
    it (the prefill refused the claim, or issued other blocks): the client's mistake,
    HTTP 400 with `param` "kv_transfer_params"."""

    def __init__(self, message: str, param: str | None = "kv_transfer_params") -> None:
        super().__init__(message, param)


class RequestFailed(RuntimeError):
    """This request failed inside the engine, which went on serving the others — HTTP 500."""


class KVTransferFailed(RuntimeError):
    """The request's KV transfer failed (policy "fail") — maps to HTTP 502."""


class KVHoldRefused(KVTransferFailed):
    """A prefill could not hold this `do_remote_decode` request's KV for a decode: the
    blocks held for decodes would exceed `hold_share` of its pool. The server is busy,
    not broken, and the blocks are already freed — HTTP 503 with Retry-After."""


class EngineDeadError(RuntimeError):
    """The engine process failed; every in-flight request fails with this."""


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the API server sees it. Lifecycle: `start()` (in the event loop),
    `await wait_ready(...)`, requests, `shutdown()`."""

    ready: asyncio.Event                        # set once started (or failed to)

    @property
    def dead(self) -> str | None:
        """Why the engine failed; None while it serves."""

    @property
    def info(self) -> EngineInfo | None:
        """What the engine resolved at start-up (None until ready)."""

    @property
    def stats(self) -> EngineStats:
        """The latest counters (summed over data-parallel replicas)."""

    @property
    def streams(self) -> Mapping[str, Any]:
        """The requests in flight, by the engine's request id."""

    def start(self) -> None: ...

    async def wait_ready(self, timeout_s: float | None) -> None:
        """Until the engine is ready; TimeoutError, or EngineDeadError if it failed."""

    def shutdown(self) -> None: ...

    def check_stalled(self) -> None:
        """Fail the requests in flight if no engine step completed within the step timeout."""

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 kv_transfer_params: dict | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The request's accumulated outputs, one per engine step that changed it; closing
        the iterator early aborts the request."""

    def abort(self, request_id: str) -> None: ...

    async def free_remote(self, request_id: str, capability: str) -> bool:
        """Free the blocks a prefill holds for a decode under `request_id`, if
        `capability` is the one they were held with; whether anything was freed."""
