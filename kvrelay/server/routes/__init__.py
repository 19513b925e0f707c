"""The API server's routes, one `APIRouter` per endpoint family; `server/api.py`'s
`build_app` puts them behind the door.

    completions.py   POST /v1/completions, POST /v1/chat/completions
    info.py          GET /health, GET /v1/models, GET /metrics
    kv_transfer.py   POST /v1/kv_transfer/free (a prefill's held blocks)
    responses.py     POST /v1/responses, GET / DELETE /v1/responses/{id}, POST …/cancel

A route finds the server's `ServerState` on its app (`server_state`), set once by
`build_app` (and the Responses store on `app.state`, set by `open_responses`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvrelay.server.serving import ServerState


def server_state(request: Request) -> ServerState:
    """The `ServerState` of the app answering `request`."""
    return request.app.state.kvrelay
