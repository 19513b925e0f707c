"""What the server says about itself: `GET /health` (200 once the engine is ready),
`GET /v1/models` (the served names, the checkpoint's directory as `root`), `GET /metrics`
(Prometheus text)."""
from __future__ import annotations

import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvrelay.server.prep import PreparedRoute
from kvrelay.server.routes import server_state
from kvrelay.server.serving import ServerState

router = APIRouter(route_class=PreparedRoute)


@router.get("/health")
async def health(request: Request) -> Response:
    return Response(status_code=200 if server_state(request).ready else 503)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    now = int(time.time())
    root = _model_root(state)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": now, "owned_by": "kvrelay",
         "root": root or name, "max_model_len": state.max_model_len}
        for name in state.served_names]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    return Response(state.metrics.render() if state.metrics else b"",
                    media_type="text/plain; version=0.0.4")


def _model_root(state: ServerState) -> str | None:
    """The checkpoint directory the engine loaded (absolute), once it is known: `/v1/models`'
    `root`, so a client on this machine (`kvrelay bench serve`'s default tokenizer,
    `kvrelay validate`) can tell which model answers under a --served-model-name."""
    model_dir = getattr(getattr(state.engine, "info", None), "model_dir", None)
    return os.path.abspath(model_dir) if isinstance(model_dir, str) and model_dir else None
