"""The engine-core process: runs `LLMEngine`'s step loop apart from HTTP work.

    API process ──("add" | "abort" | "shutdown")──▶ engine core (this module)
    API process ◀──("ready" | "outputs" | "error" | "fatal")── engine core

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
        "padded_tokens": 0,
    }


def as_delta(out: RequestOutput) -> RequestOutput:
    """Drop the cumulative fields; the client accumulates the deltas."""
    outputs = [replace(o, text="", token_ids=[], logprobs=None) for o in out.outputs]
    return replace(out, outputs=outputs)


def run_engine_core(args: EngineArgs, conn: Connection, log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # the API process decides when to stop
    try:
        from kvrelay.engine.core import LLMEngine
        engine = LLMEngine(args)
        conn.send(("ready", {
            "max_model_len": engine.max_model_len, "model_dir": str(engine.model_dir),
            "pid": os.getpid(), "stats": engine_stats(engine),
            "kv_cache_spec": engine.kv_cache_spec().__dict__,
        }))
    except BaseException as e:  # report any startup failure in one line, then exit
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        logger.debug(traceback.format_exc())
        return
    try:
        _loop(engine, conn)
    finally:
        engine.shutdown()


def _loop(engine: Any, conn: Connection) -> None:
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)                              # idle: sleep until a message
        while conn.poll(0):
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "shutdown":
                return
            _handle(engine, conn, message)
        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except BaseException as e:
                conn.send(("fatal", f"engine step failed: {type(e).__name__}: {e}"))
                logger.error(traceback.format_exc())
                return
            conn.send(("outputs", [as_delta(o) for o in outputs], engine_stats(engine)))


def _handle(engine: Any, conn: Connection, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
        _, request_id, prompt, params = message
        try:
            engine.add_request(request_id, prompt, params)
        except ValueError as e:
            conn.send(("error", request_id, str(e)))
    elif kind == "abort":
        for request_id in message[1]:
            engine.abort_request(request_id)
        conn.send(("outputs", [], engine_stats(engine)))
    elif kind == "stats":
        conn.send(("outputs", [], engine_stats(engine)))
