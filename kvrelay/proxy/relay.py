"""Relaying a decode server's answer to the client: streamed chunk by chunk (`RelayStream`)
or whole, with the client's disconnect cancelling the backend request."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from kvrelay.proxy import responses
from kvrelay.proxy.answers import client_closed, copy_response, describe, error_response, id_header
from kvrelay.proxy.legs import DecodeLeg

logger = logging.getLogger("kvrelay.proxy")

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection while the proxy was waiting on a backend."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which closes its backend connection) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


class RelayStream(Response):
    """Relays a decode server's streamed body chunk by chunk (no buffering). Watches the client
    connection meanwhile: a disconnect closes the decode stream at once, so decode aborts."""

    def __init__(self, leg: DecodeLeg, request_id: str, on_end: Callable[[str], None],
                 sniffer: responses.StreamSniffer | None = None) -> None:
        self.leg, self.on_end, self.sniffer = leg, on_end, sniffer
        self.status_code = leg.response.status_code
        self.media_type = leg.response.headers.get("content-type")
        self.background = None
        self.init_headers(id_header(request_id))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "disconnected"
        try:
            outcome = await unless_disconnected(receive, self._relay(send))
        except (ClientGone, OSError):      # ASGI 2.4 servers report a closed connection on send
            outcome = "disconnected"
        finally:
            with anyio.CancelScope(shield=True):
                await self.leg.response.aclose()
            self.on_end(outcome)

    async def _relay(self, send: Send) -> str:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        tail = b"\n\n"                   # the last two bytes relayed: are we between SSE events?
        try:
            async for chunk in self.leg.response.aiter_raw():
                if chunk:
                    if self.sniffer is not None:
                        self.sniffer.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    tail = (tail + chunk)[-2:]
        except httpx.TransportError as e:
            return await self._cut(send, e, tail == b"\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return "done"

    async def _cut(self, send: Send, e: httpx.TransportError, between_events: bool) -> str:
        """The decode stream broke. Between SSE events, end it the way kvrelay serve reports a
        failed stream (an error event, then [DONE]); otherwise leave the response incomplete,
        which makes the server drop the connection so the client sees the failure."""
        message = f"decode server {self.leg.backend.name} broke off the stream: {describe(e)}"
        logger.warning(message)
        if between_events and (self.media_type or "").startswith("text/event-stream"):
            error = {"message": message, "type": "ServiceUnavailableError", "param": None,
                     "code": 503}
            tail = f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        return "upstream_error"


async def decode_whole(request: Request, leg: DecodeLeg, request_id: str,
                       end: Callable[[str], None]) -> Response:
    """A non-streamed decode answer (or a decode error), read whole and returned as is."""
    outcome = "disconnected"
    try:
        content = await unless_disconnected(request.receive, leg.response.aread())
        outcome = "done" if leg.response.is_success else f"http_{leg.response.status_code}"
        return copy_response(leg.response, content, request_id)
    except ClientGone:
        return client_closed(request_id, "before decode finished")
    except httpx.TransportError as e:
        outcome = "upstream_error"
        return error_response(502, f"decode server {leg.backend.name} failed: {describe(e)}",
                              "BadGatewayError", request_id)
    finally:
        with anyio.CancelScope(shield=True):
            await leg.response.aclose()
        end(outcome)
