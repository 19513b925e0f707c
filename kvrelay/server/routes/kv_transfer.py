"""`POST /v1/kv_transfer/free`: a prefill frees the blocks it holds for a decode that will
not read them (kvrelay's proxy sends it with the prefill's kv_transfer_params)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kvrelay.server.prep import PreparedRoute
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.routes import server_state

router = APIRouter(route_class=PreparedRoute)


class KVTransferFreeRequest(BaseModel):
    """`POST /v1/kv_transfer/free`: the prefill's kv_transfer_params name the request and
    its capability (kvrelay's proxy sends them when a decode will not read)."""
    remote_request_id: str = Field(min_length=1, max_length=1024)
    remote_capability: str = Field(min_length=1, max_length=256)
    remote_engine_id: str | None = None


@router.post("/v1/kv_transfer/free", response_model=None)
async def kv_transfer_free(body: KVTransferFreeRequest, request: Request) -> dict[str, bool]:
    """Prefill side: release blocks held for a decode that will not read them. Only
    with the request's remote_capability; an unknown id and a wrong capability get
    the same 404, so the answer tells nothing about other requests."""
    engine = server_state(request).engine
    if not await engine.free_remote(body.remote_request_id, body.remote_capability):
        raise OpenAIError("no KV blocks are held for this remote_request_id with this "
                          "remote_capability", 404, "NotFoundError", "remote_request_id")
    return {"ok": True}
