"""The engine-core process: runs `LLMEngine`'s step loop apart from HTTP work.

    API process ──AddRequest | AbortRequests | FreeRemote | Shutdown──▶ engine core (here)
    API process ◀──Ready | StepOutputs | RequestRefused | Freed | Fatal── engine core

(`kvrelay/engine/messages.py` defines them.) `RequestRefused` refuses one request:
status 400 for a request the engine rejects (`param` names the field), 500 when adding
it raised anything else (nothing of it stays in the engine). Failures inside a step
come back as that request's final output with `error` set (see
`LLMEngine._fail_request`); `Fatal` is kept for what breaks shared state (a scheduler
or KV-cache exception, a failed KV pool integrity check) and ends the engine.

Messages are small picklable dataclasses over a `multiprocessing` pipe; outputs carry
only what changed in the step (new token ids, new text, new logprobs), never tensors.
The loop blocks on the pipe when idle and only polls it between steps when busy, so the
step loop never waits on HTTP.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import pickle
import select
import signal
import time
import traceback
from contextlib import nullcontext
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import IO, Any, Protocol

from kvrelay import envs
from kvrelay.config import EngineArgs
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


class CoreEngine(Protocol):
    """What this loop (and `lockstep.py`) needs of `LLMEngine`."""

    kv: Any
    scheduler: Any
    num_steps: int
    num_dummy_steps: int

    @property
    def connector(self) -> Any: ...
    @property
    def expert_world(self) -> Any: ...
    @property
    def transfer_busy(self) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...
    def add_request(self, request_id: str, prompt: Any, params: Any,
                    kv_transfer_params: dict | None = None) -> Any: ...
    def abort_request(self, request_id: str) -> None: ...
    def free_remote(self, request_id: str, capability: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def plan_step(self) -> Any: ...
    def run_planned(self, plan: Any, counts: tuple[int, ...]) -> list[RequestOutput]: ...
    def shutdown(self) -> None: ...


def engine_stats(engine: CoreEngine) -> EngineStats:
    kv, sched = engine.kv, engine.scheduler
    return EngineStats(
        num_requests_running=len(sched.running),
        num_requests_waiting=len(sched.waiting),
        kv_cache_usage_perc=kv.pool.usage,
        blocks_free=kv.pool.num_free,
        blocks_used=kv.pool.num_used,
        blocks_total=kv.pool.num_blocks - 1,
        prefix_cache_queries=kv.stats.queries,
        prefix_cache_hits=kv.stats.hits,
        num_preemptions=sched.num_preemptions,
        num_steps=engine.num_steps,
        dp_dummy_steps=engine.num_dummy_steps,
        **transfer_stats(engine),
        **spec_decode_stats(engine),
    )


def spec_decode_stats(engine: CoreEngine) -> dict[str, Any]:
    """The `spec_decode_*` fields of `EngineStats` (none without --speculative-config;
    `LLMEngine.spec_stats`, which stand-in engines need not have)."""
    s = getattr(engine, "spec_stats", None)
    if s is None:
        return {}
    return {"spec_decode_num_drafts": s.num_drafts,
            "spec_decode_num_draft_tokens": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
            "spec_decode_accepted_per_pos": tuple(s.accepted_per_pos)}


def transfer_stats(engine: CoreEngine) -> dict[str, Any]:
    """The `kv_*` fields of `EngineStats` (none without a KV connector)."""
    c = engine.connector
    if c is None:
        return {}
    held = sum(engine.kv.num_blocks_held(r) for r in engine.scheduler.held)
    s = c.stats
    return {"kv_transfers": s.transfers, "kv_transfer_failures": s.failed,
            "kv_transfer_bytes": s.bytes, "kv_transfer_seconds": s.seconds,
            "kv_handshakes": s.handshakes, "kv_handshake_errors": s.handshake_errors,
            "kv_transport_fallbacks": s.transport_fallbacks,
            "kv_blocks_held_for_remote": held,
            "kv_requests_held_for_remote": len(engine.scheduler.held),
            "kv_leases_expired": s.leases_expired, "kv_read_done_notices": s.read_done_notices,
            "kv_loads_in_flight": len(c.loads)}


def run_engine_core(args: EngineArgs, conn: Connection, log_level: int = logging.INFO) -> None:
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


STATS_EVERY_S = 0.1        # while steps run without outputs (a long prefill), stats this often


class _Switching:
    """The loop's side of `NativeSwitch` (engine/native_switch.py): between two steps, switch
    to the native kernels once their background build is done, and tell the API process
    (a second `Ready` carrying the new `native` paths: its metrics read them from there)."""

    def __init__(self, switch: Any, info: EngineInfo) -> None:
        self.switch, self.info = switch, info

    def idle_wait(self) -> float | None:
        return self.switch.idle_wait()

    def between_steps(self, engine: Any, conn: Connection) -> None:
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


def _loop(engine: CoreEngine, conn: Connection, switching: _Switching | None = None) -> None:
    with _step_trace() as trace:
        _run(engine, conn, trace, switching)


def _run(engine: CoreEngine, conn: Connection, trace: IO[str] | None,
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
        if not engine.has_unfinished_requests():
            # idle: sleep until a message (or poll transfers/leases every 10 ms, or a
            # background kernel build)
            conn.poll(0.01 if engine.transfer_busy else idle_wait())
        while waiting.poll(0):
            try:
                message = conn.recv()
            except EOFError:
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
                # plain pickle (Connection.send's ForkingPickler copies the copyreg dispatch
                # table per message); the API's Connection.recv unpickles it the same
                conn.send_bytes(pickle.dumps(StepOutputs(_deltas(outputs, announced), stats),
                                             pickle.HIGHEST_PROTOCOL))
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


def handle(engine: CoreEngine, conn: Connection, message: ToEngine) -> None:
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


def _add(engine: CoreEngine, conn: Connection, message: AddRequest) -> None:
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


def _control(engine: CoreEngine, conn: Connection, message: ToEngine) -> None:
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
