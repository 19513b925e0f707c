"""The engine-core process: runs `LLMEngine`'s step loop apart from HTTP work.

    API process ──AddRequest | AbortRequests | FreeRemote | Shutdown──▶ engine core (here)
    API process ◀──Ready | StepOutputs | RequestRefused | Freed | Fatal── engine core

(`kvrelay/engine/messages.py` defines them.) `RequestRefused` refuses one request:
status 400 for a request the engine rejects (`param` names the field), 500 when adding
it raised anything else (nothing of it stays in the engine). Failures inside a step
come back as that request's final output with `error` set (see
`LLMEngine._fail_request`); `Fatal` is kept for what breaks shared state (a scheduler
or KV-cache exception, a failed KV pool integrity check) and ends the engine.

Messages are msgspec Structs over a `multiprocessing` pipe, in the one codec of
`engine/codec.py` (`MessagePipe`); outputs carry only what changed in the step (new token
ids, new text, new logprobs), never tensors.
The loop blocks on the pipe when idle and only polls it between steps when busy, so the
step loop never waits on HTTP.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import select
import signal
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from multiprocessing.connection import Connection
from typing import IO, Any

from msgspec.structs import replace

from kvrelay import envs
from kvrelay.config import EngineArgs
from kvrelay.engine.codec import TO_ENGINE, CodecError, MessagePipe
from kvrelay.engine.core_stats import CoreEngine, engine_stats
from kvrelay.engine.lockstep import run_lockstep
from kvrelay.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineStats,
    Fatal,
    Freed,
    FreeRemote,
    Ready,
    RequestRefused,
    Shutdown,
    StepOutputs,
    ToEngine,
    as_delta,
)
from kvrelay.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


CorePipe = MessagePipe[ToEngine]       # the core's end of its pipe to the API process


def run_engine_core(args: EngineArgs, end: Connection, log_level: int = logging.INFO) -> None:
    conn = MessagePipe(end, TO_ENGINE)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # the API process decides when to stop
    try:
        # imported in the core process only: the API process must not load torch
        from kvrelay.engine.core import LLMEngine
        from kvrelay.engine.native_switch import NativeSwitch
        from kvrelay.model.fast_paths import native_paths
        switch = NativeSwitch.start(args)       # a missing kernel build: in the background
        engine = LLMEngine(args)
        keep_freed_memory()
        freeze_startup_objects()
        info = EngineInfo(max_model_len=engine.max_model_len, model_dir=str(engine.model_dir),
                          pid=os.getpid(), vocab_size=engine.model_config.vocab_size,
                          kv_cache_spec=dict(engine.kv_cache_spec().__dict__),
                          native=native_paths())    # the CPU kernels/matmul path in use
        conn.send(Ready(info, engine_stats(engine)))
    except BaseException as e:  # report any startup failure in one line, then exit
        conn.send(Fatal(f"{type(e).__name__}: {e}"))
        logger.debug(traceback.format_exc())
        return
    try:
        if engine.expert_world is not None:            # experts across DP replicas
            run_lockstep(engine, conn, handle, engine_stats)
        else:
            _loop(engine, conn, _Switching(switch, info))
    finally:
        from kvrelay.model import kernels
        kernels.stop_background_build()
        engine.shutdown()


def keep_freed_memory() -> bool:
    """From here on, glibc serves every allocation from its heap and keeps freed memory for
    reuse, instead of mapping fresh pages for each large block and unmapping them on free.

    A step allocates and frees the same large tensors every time (a decode step of 64
    sequences over a 201k vocabulary makes 51 MB of float32 logits): above glibc's mmap
    threshold (at most 32 MB) each one is a fresh mapping whose pages fault in, zeroed, on
    first touch — measured 47 instead of 25 ms of CPU per such step, depending on whether
    huge pages happened to back it. Called after loading and warm-up, so the loader's
    transient buffers still go back to the system; the heap then stays at the steady
    state's peak. A no-op where the C library is not glibc, or with
    KVRELAY_ENGINE_KEEP_FREED_MEMORY=0. Returns whether it took effect."""
    setting = envs.ENGINE_KEEP_FREED_MEMORY.raw()
    if setting not in ("0", "1"):
        raise ValueError(f"{envs.ENGINE_KEEP_FREED_MEMORY.shown}: expected 0 or 1, "
                         f"got {setting!r}")
    if setting == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        ok = 0
    logger.debug("engine core: freed memory kept for reuse: %s", bool(ok))
    return bool(ok)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4          # glibc's mallopt parameters (malloc.h)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, the model's Python objects, the
    tokenizer) out of the garbage collector's reach: a full collection then walks only what
    steps allocate, not the whole process, so it cannot pause a step for milliseconds
    (~190 ms for the API process's ~200k objects, measured). They are handed back at exit,
    so finalisation still frees them (native bindings report what is never freed)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def _step_trace() -> IO[str] | nullcontext[None]:
    """KVRELAY_STEP_TRACE: the file each step's timing line goes to (line-buffered: a server
    stopped by a signal still leaves every finished step's line)."""
    path = envs.STEP_TRACE.raw()
    return open(path, "a", buffering=1) if path else nullcontext()


IDLE_STEP_WAIT_S = 0.001  # after a step with nothing to run while requests wait
STATS_EVERY_S = 0.1        # while steps run without outputs (a long prefill), stats this often


class _Switching:
    """The loop's side of `NativeSwitch` (engine/native_switch.py): between two steps, switch
    to the native kernels once their background build is done, and tell the API process
    (a second `Ready` carrying the new `native` paths: its metrics read them from there)."""

    def __init__(self, switch: Any, info: EngineInfo) -> None:
        self.switch, self.info = switch, info

    def idle_wait(self) -> float | None:
        return self.switch.idle_wait()

    def between_steps(self, engine: Any, conn: CorePipe) -> None:
        if not self.switch.pending:
            return
        pipeline = engine.pipeline
        if not self.switch.due(pipeline_busy=pipeline is not None and pipeline.busy):
            return
        from kvrelay.model.fast_paths import native_paths
        self.switch.apply(engine.model, engine.executor, engine.runner.num_groups,
                          engine.args.block_size)
        self.info = replace(self.info, native=native_paths())
        conn.send(Ready(self.info, engine_stats(engine)))


def _wait(engine: CoreEngine, conn: CorePipe, idle_wait: Callable[[], float | None]) -> None:
    """Before the messages and the next step: idle, sleep until a message (or poll
    transfers/leases every 10 ms, or a background kernel build); when every request waits
    (its remote KV loading, mostly: the last step ran nothing), a millisecond or until a
    message, rather than spin a core that a prefill server beside this one may share."""
    if not engine.has_unfinished_requests():
        conn.poll(0.01 if engine.transfer_busy else idle_wait())
    elif engine.last_step_idle:
        conn.poll(IDLE_STEP_WAIT_S)


def _loop(engine: CoreEngine, conn: CorePipe, switching: _Switching | None = None) -> None:
    with _step_trace() as trace:
        _run(engine, conn, trace, switching)


def _run(engine: CoreEngine, conn: CorePipe, trace: IO[str] | None,
         switching: _Switching | None = None) -> None:
    last_stats: EngineStats | None = None
    last_sent = time.monotonic()
    announced: set[str] = set()          # requests whose first message (with the prompt) went out
    # between steps, one poll(2) call: Connection.poll(0) builds a selector each time
    waiting = select.poll()
    waiting.register(conn.fileno(), select.POLLIN)
    idle_wait = switching.idle_wait if switching is not None else lambda: None
    while True:
        if switching is not None:
            try:
                switching.between_steps(engine, conn)
            except BaseException as e:
                conn.send(Fatal(f"switching to the native kernels failed: "
                                f"{type(e).__name__}: {e}"))
                logger.error(traceback.format_exc())
                return
        _wait(engine, conn, idle_wait)
        while waiting.poll(0):
            try:
                message = conn.recv()
            except EOFError:
                return
            except CodecError as e:
                conn.send(Fatal(f"the engine core received no engine message: {e}"))
                return
            if isinstance(message, Shutdown):
                return
            try:
                handle(engine, conn, message)
            except BaseException as e:
                conn.send(Fatal(f"engine failed handling {message.tag!r}: "
                                f"{type(e).__name__}: {e}"))
                logger.error(traceback.format_exc())
                return
            if isinstance(message, AbortRequests):
                announced.difference_update(message.request_ids)
        if engine.has_unfinished_requests() or engine.transfer_busy:
            started = time.monotonic()
            try:
                outputs = engine.step()
            except BaseException as e:
                conn.send(Fatal(f"engine step failed: {type(e).__name__}: {e}"))
                logger.error(traceback.format_exc())
                return
            stepped = time.monotonic()
            stats = engine_stats(engine)
            # one message per step with outputs; changed stats alone go out when the engine
            # idles, or 0.1 s after the last message (a step about to run sends them with
            # its outputs: a message wakes the API process, which then competes with that
            # step for the cores)
            if outputs or (stats != last_stats and (not engine.has_unfinished_requests()
                                                    or stepped - last_sent > STATS_EVERY_S)):
                last_sent = stepped
                conn.send(StepOutputs(_deltas(outputs, announced), stats))
                last_stats = stats
            if trace is not None:
                trace.write(f"{started:.6f} {stepped:.6f} {time.monotonic():.6f} "
                            f"{len(outputs)}\n")


def _deltas(outputs: list[RequestOutput], announced: set[str]) -> list[RequestOutput]:
    deltas = []
    for out in outputs:
        deltas.append(as_delta(out, first=out.request_id not in announced))
        if out.finished:
            announced.discard(out.request_id)
        else:
            announced.add(out.request_id)
    return deltas


def handle(engine: CoreEngine, conn: CorePipe, message: ToEngine) -> None:
    """One message from the API process (`Shutdown` and `Wake` are the loops' own)."""
    if isinstance(message, AddRequest):
        _add(engine, conn, message)
        return
    try:
        _control(engine, conn, message)
    except Exception:  # noqa: BLE001 -- survivable only if the KV pool is still consistent
        logger.error("handling %r failed:\n%s", message.tag, traceback.format_exc())
        engine.kv.check_integrity()
        conn.send(StepOutputs([], engine_stats(engine)))


def _add(engine: CoreEngine, conn: CorePipe, message: AddRequest) -> None:
    """add_request is all-or-nothing, so a refused or failed add touches no one else."""
    request_id = message.request_id
    try:
        engine.add_request(request_id, message.prompt, message.params, message.kv_transfer_params)
    except ValueError as e:                      # the request is invalid: the client's mistake
        conn.send(RequestRefused(request_id, str(e), 400, getattr(e, "param", None)))
    except Exception as e:  # noqa: BLE001 -- e.g. a logits-processor factory that raised
        logger.error("adding request %s failed:\n%s", request_id, traceback.format_exc())
        why = f"the engine could not add the request: {type(e).__name__}: {e}"
        conn.send(RequestRefused(request_id, why, 500, None))


def _control(engine: CoreEngine, conn: CorePipe, message: ToEngine) -> None:
    if isinstance(message, FreeRemote):
        freed = engine.free_remote(message.request_id, message.capability)
        conn.send(Freed(message.token, freed))
        conn.send(StepOutputs([], engine_stats(engine)))
    elif isinstance(message, AbortRequests):
        for request_id in message.request_ids:
            engine.abort_request(request_id)
        conn.send(StepOutputs([], engine_stats(engine)))
    else:
        raise ValueError(f"the engine core does not handle {type(message).__name__}")
