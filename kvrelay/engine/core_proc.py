"""The engine-core process: runs `LLMEngine`'s step loop apart from HTTP work.

    API process ──("add" | "abort" | "shutdown")──▶ engine core (this module)
    API process ◀──("ready" | "outputs" | "error" | "fatal")── engine core

("error", request_id, message, status, param) refuses one request: status 400 for a
request the engine rejects (`param` names the field), 500 when adding it raised
anything else (nothing of it stays in the engine). Failures inside a step come back
as that request's final output with `error` set (see `LLMEngine._fail_request`);
"fatal" is kept for what breaks shared state (a scheduler or KV-cache exception,
a failed KV pool integrity check) and ends the engine.

Messages are small picklable tuples over a `multiprocessing` pipe; outputs carry only
what changed in the step (new token ids, new text, new logprobs), never tensors. The
loop blocks on the pipe when idle and only polls it between steps when busy, so the
step loop never waits on HTTP.
"""
from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from kvrelay.config import EngineArgs
from kvrelay.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


def engine_stats(engine: Any) -> dict[str, float]:
    kv, sched = engine.kv, engine.scheduler
    return {
        "num_requests_running": len(sched.running),
        "num_requests_waiting": len(sched.waiting),
        "kv_cache_usage_perc": kv.pool.usage,
        "blocks_free": kv.pool.num_free,
        "blocks_used": kv.pool.num_used,
        "blocks_total": kv.pool.num_blocks - 1,
        "prefix_cache_queries": kv.stats.queries,
        "prefix_cache_hits": kv.stats.hits,
        "num_preemptions": sched.num_preemptions,
        "num_steps": engine.num_steps,
        "dp_dummy_steps": getattr(engine, "num_dummy_steps", 0),
        "padded_tokens": 0,
        **transfer_stats(engine),
    }


def transfer_stats(engine: Any) -> dict[str, float]:
    c = engine.connector
    if c is None:
        return {}
    held = sum(engine.kv.num_blocks_held(r) for r in engine.scheduler.held)
    s = c.stats
    return {"kv_transfers": s.transfers, "kv_transfer_failures": s.failed, "kv_transfer_bytes": s.bytes,
            "kv_transfer_seconds": s.seconds, "kv_handshakes": s.handshakes,
            "kv_handshake_errors": s.handshake_errors, "kv_transport_fallbacks": s.transport_fallbacks,
            "kv_blocks_held_for_remote": held, "kv_requests_held_for_remote": len(engine.scheduler.held),
            "kv_leases_expired": s.leases_expired, "kv_read_done_notices": s.read_done_notices,
            "kv_loads_in_flight": len(c.loads)}


def as_delta(out: RequestOutput, first: bool = True) -> RequestOutput:
    """Drop the cumulative fields; the client accumulates the deltas. After a request's
    first message the prompt (text and ids) is left out too: the client keeps the first
    message's, and a long prompt re-pickled every step costs O(prompt) per token."""
    outputs = [replace(o, text="", token_ids=[], logprobs=None) for o in out.outputs]
    if first:
        return replace(out, outputs=outputs)
    return replace(out, outputs=outputs, prompt=None, prompt_token_ids=[])


def run_engine_core(args: EngineArgs, conn: Connection, log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # the API process decides when to stop
    try:
        from kvrelay.engine.core import LLMEngine
        from kvrelay.model.fast_paths import native_paths
        engine = LLMEngine(args)
        conn.send(("ready", {
            "max_model_len": engine.max_model_len, "model_dir": str(engine.model_dir),
            "pid": os.getpid(), "stats": engine_stats(engine),
            "vocab_size": engine.model_config.vocab_size,
            "kv_cache_spec": engine.kv_cache_spec().__dict__,
            "native": native_paths(),       # once: the CPU kernels/matmul path in use
        }))
    except BaseException as e:  # report any startup failure in one line, then exit
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        logger.debug(traceback.format_exc())
        return
    try:
        if getattr(engine, "expert_world", None) is not None:   # experts across DP replicas
            from kvrelay.engine.lockstep import run_lockstep
            run_lockstep(engine, conn, _handle, engine_stats)
        else:
            _loop(engine, conn)
    finally:
        engine.shutdown()


def _loop(engine: Any, conn: Connection) -> None:
    last_stats: dict[str, float] = {}
    announced: set[str] = set()          # requests whose first message (with the prompt) went out
    while True:
        if not engine.has_unfinished_requests():
            # idle: sleep until a message (or poll transfers/leases every 10 ms)
            conn.poll(0.01 if engine.transfer_busy else None)
        while conn.poll(0):
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "shutdown":
                return
            try:
                _handle(engine, conn, message)
            except BaseException as e:
                conn.send(("fatal", f"engine failed handling {message[0]!r}: {type(e).__name__}: {e}"))
                logger.error(traceback.format_exc())
                return
            if message[0] == "abort":
                announced.difference_update(message[1])
        if engine.has_unfinished_requests() or engine.transfer_busy:
            try:
                outputs = engine.step()
            except BaseException as e:
                conn.send(("fatal", f"engine step failed: {type(e).__name__}: {e}"))
                logger.error(traceback.format_exc())
                return
            stats = engine_stats(engine)
            if outputs or stats != last_stats:
                conn.send(("outputs", _deltas(outputs, announced), stats))   # one message per step
                last_stats = stats


def _deltas(outputs: list[RequestOutput], announced: set[str]) -> list[RequestOutput]:
    deltas = []
    for out in outputs:
        deltas.append(as_delta(out, first=out.request_id not in announced))
        if out.finished:
            announced.discard(out.request_id)
        else:
            announced.add(out.request_id)
    return deltas


def _handle(engine: Any, conn: Connection, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
        _add(engine, conn, message)
        return
    try:
        _control(engine, conn, message)
    except Exception:  # noqa: BLE001 -- survivable only if the KV pool is still consistent
        logger.error("handling %r failed:\n%s", kind, traceback.format_exc())
        engine.kv.check_integrity()
        conn.send(("outputs", [], engine_stats(engine)))


def _add(engine: Any, conn: Connection, message: tuple) -> None:
    """add_request is all-or-nothing, so a refused or failed add touches no one else."""
    _, request_id, prompt, params, kv_transfer_params = message
    try:
        engine.add_request(request_id, prompt, params, kv_transfer_params)
    except ValueError as e:                      # the request is invalid: the client's mistake
        conn.send(("error", request_id, str(e), 400, getattr(e, "param", None)))
    except Exception as e:  # noqa: BLE001 -- e.g. a logits-processor factory that raised
        logger.error("adding request %s failed:\n%s", request_id, traceback.format_exc())
        why = f"the engine could not add the request: {type(e).__name__}: {e}"
        conn.send(("error", request_id, why, 500, None))


def _control(engine: Any, conn: Connection, message: tuple) -> None:
    kind = message[0]
    if kind == "free_remote":                    # (kind, request id, capability, token)
        freed = engine.free_remote(message[1], message[2])
        conn.send(("freed", message[3], freed))
        conn.send(("outputs", [], engine_stats(engine)))
    elif kind == "abort":
        for request_id in message[1]:
            engine.abort_request(request_id)
        conn.send(("outputs", [], engine_stats(engine)))
    elif kind == "stats":
        conn.send(("outputs", [], engine_stats(engine)))
