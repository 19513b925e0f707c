"""`kvrelay serve`: start the engine-core process(es) for a resolved EngineConfig, then
serve HTTP (server/http_server.py).

The engine core's process starts first, before this process imports its HTTP stack
(FastAPI, uvicorn and the API's routes: ~0.7 s of CPU, more on shared cores): the core's
own imports and weights then overlap them, and a server is ready that much sooner.
"""
from __future__ import annotations

from kvrelay import envs
from kvrelay.config import EngineConfig
from kvrelay.engine.async_client import AsyncEngine
from kvrelay.engine.client import EngineClient
from kvrelay.server.options import HTTPOptions
from kvrelay.server.tools import AgentOptions


def serve(config: EngineConfig, http: HTTPOptions, agent: AgentOptions | None = None) -> int:
    """Serve `config`'s engine over HTTP as `http` says, until stopped; the exit code."""
    args = config.args
    timeout = envs.EXECUTE_MODEL_TIMEOUT_S.as_float()
    core: EngineClient
    if args.data_parallel_size > 1:
        from kvrelay.engine.data_parallel import DataParallelEngine
        core = DataParallelEngine(args, step_timeout_s=timeout)
    else:
        core = AsyncEngine(args, step_timeout_s=timeout)
        core.launch()             # the engine core loads while this process sets up its API
    from kvrelay.server.http_server import serve_http  # the HTTP stack, now (see above)
    try:
        return serve_http(config, http, agent, core)
    finally:
        if isinstance(core, AsyncEngine) and core.launched:
            # a no-op after uvicorn's lifespan stopped it; the one stop where uvicorn never
            # ran (a port taken meanwhile): no orphaned core
            core.shutdown()
