"""`kvrelay serve`'s HTTP side: the API app around a started engine client, under uvicorn.

Readiness: uvicorn starts at once (so `/health` answers 503 while the model loads);
"Application startup complete." is logged only when the engine is ready — the line
the tutorial waits for. SIGINT/SIGTERM drain: stop accepting, let in-flight requests
finish within the graceful-shutdown bound, stop the engine, exit 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvrelay import envs
from kvrelay.config import EngineConfig
from kvrelay.engine.client import EngineClient
from kvrelay.malloc import return_large_buffers_to_the_os
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.server.admission import Admission, AdmittedEngine
from kvrelay.server.api import ServerState, build_app
from kvrelay.server.chat import make_chat_renderer
from kvrelay.server.grammar_check import configure as configure_grammar_checks
from kvrelay.server.hold_limit import HoldRateLimiter
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.options import HTTPOptions
from kvrelay.server.prompt_tokens import tokenizer_facts
from kvrelay.server.tools import AgentOptions

logger = logging.getLogger("kvrelay.server")
READY_LINE = "Application startup complete."
GRACEFUL_SHUTDOWN_S = 30


class _HideEarlyReadyLine(logging.Filter):
    """uvicorn says "Application startup complete." when HTTP is up; we say it when the
    engine is ready, so its own early line is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "kvrelay", False) or READY_LINE not in record.getMessage()


class _DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would end the
    process "killed by signal"; a drained shutdown is a clean exit, so we swallow them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """generation_config.json's sampling defaults (vLLM's `--generation-config auto`)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k") if k in cfg}


def hold_limiter(config: EngineConfig) -> HoldRateLimiter | None:
    """A prefill's per-client bound on do_remote_decode holds (None: no KV producer, or
    hold_rate 0)."""
    kv = config.kv_transfer
    if kv is None or not kv.is_producer or kv.hold_rate == 0:
        return None
    return HoldRateLimiter(kv.hold_rate, kv.hold_burst)


def uvicorn_proxy_options(forwarded_allow_ips: str | None) -> dict[str, Any]:
    """uvicorn trusts X-Forwarded-For/-Proto from 127.0.0.1 unless told otherwise, so any
    local process could choose the client address we log and rate-bound by. Trusted only
    from the addresses the operator names (`--forwarded-allow-ips`, uvicorn's name)."""
    if not forwarded_allow_ips:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": forwarded_allow_ips}


def serve_http(config: EngineConfig, http: HTTPOptions, agent: AgentOptions | None,
               core: EngineClient) -> int:
    """`serve`'s API server around `core` (its process started or not), until stopped;
    the exit code."""
    model_dir, names, args = config.model_dir, list(config.served_names), config.args
    limits = http.limits(args.max_num_seqs * args.data_parallel_size)
    tokenizer = load_tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    configure_grammar_checks(model_dir if tokenizer is not None else None)  # its worker starts
    admission = Admission(limits)
    engine = AdmittedEngine(core, admission)
    facts = tokenizer_facts(tokenizer)     # bytes-per-token bound, once (server/prompt_tokens.py)
    return_large_buffers_to_the_os()       # a large body's buffers do not stay resident
    # max_model_len 0 until the engine is ready: /health and every /v1 route answer 503 till then
    state = ServerState(engine=engine, tokenizer=tokenizer, served_names=names, max_model_len=0,
                       max_logprobs=args.max_logprobs, api_key=http.api_key,
                       defaults=sampling_defaults(model_dir), token_facts=facts,
                       chat=make_chat_renderer(tokenizer, facts), agent=agent or AgentOptions())
    state.metrics = ServerMetrics(lambda: engine.stats, names[0], lambda: engine.info,
                                  admission)
    state.hold_limiter = hold_limiter(config)
    app = build_app(state)
    outcome = {"rc": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        tasks = [asyncio.create_task(_await_ready(engine, state, server, outcome)),
                 asyncio.create_task(_watchdog(engine, server, outcome))]
        try:
            yield
        finally:
            state.accepting = False
            for t in tasks:
                t.cancel()
            engine.shutdown()

    app.router.lifespan_context = lifespan
    listen = uvicorn.Config(app, host=http.host, port=http.port, log_level="info",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            **uvicorn_proxy_options(http.forwarded_allow_ips))
    server = _DrainingServer(listen)
    logging.getLogger("uvicorn.error").addFilter(_HideEarlyReadyLine())
    logger.info("serving %s as %s on http://%s:%d", model_dir, ", ".join(names), http.host,
                http.port)
    server.run()
    return outcome["rc"]


async def _await_ready(engine: EngineClient, state: ServerState, server: uvicorn.Server,
                       outcome: dict[str, int]) -> None:
    timeout = envs.ENGINE_READY_TIMEOUT_S.as_float()
    try:
        await engine.wait_ready(timeout)
    except TimeoutError:
        logger.error("the engine was not ready within %.0fs; raise %s", timeout,
                     envs.ENGINE_READY_TIMEOUT_S.shown)
        outcome["rc"] = 1
        server.should_exit = True
        return
    except Exception as e:
        logger.error("engine failed to start: %s", e)
        outcome["rc"] = 1
        server.should_exit = True
        return
    info = engine.info
    assert info is not None, "wait_ready returns once the core sent its start-up info"
    state.max_model_len = info.max_model_len
    state.vocab_size = info.vocab_size
    logging.getLogger("uvicorn.error").info(READY_LINE, extra={"kvrelay": True})


async def _watchdog(engine: EngineClient, server: uvicorn.Server, outcome: dict[str, int]) -> None:
    """Fails stalled requests; when the engine process has died (e.g. a tensor-parallel
    worker was killed) the in-flight requests have already failed with 503 and the
    server shuts down with exit code 1."""
    while True:
        await asyncio.sleep(0.5)
        engine.check_stalled()
        if engine.ready.is_set() and engine.dead is not None:
            logger.error("stopping: %s", engine.dead)
            outcome["rc"] = 1
            server.should_exit = True
            return
