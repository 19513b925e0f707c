"""What the proxy answers itself: OpenAI error bodies, a backend's answer copied, 499 for a
client that left, and transport errors described in a few words."""
from __future__ import annotations

import logging

import httpx
from fastapi.responses import JSONResponse, Response

logger = logging.getLogger("kvrelay.proxy")

CLIENT_CLOSED = 499              # nginx's "client closed request", for metrics and logs


def error_response(status: int, message: str, type_: str, request_id: str | None = None,
                   param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=id_header(request_id))


def id_header(request_id: str | None) -> dict[str, str]:
    return {"X-Request-Id": request_id} if request_id else {}


def copy_response(resp: httpx.Response, content: bytes, request_id: str) -> Response:
    """A backend's status, body and content type, as they came; its Retry-After too (a
    prefill's 429 over the hold rate, 503 with a full hold share)."""
    headers = id_header(request_id)
    if "retry-after" in resp.headers:
        headers["Retry-After"] = resp.headers["retry-after"]
    return Response(content, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))


def describe(e: Exception) -> str:
    if isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
        return "connection timed out"
    if isinstance(e, httpx.ConnectError):
        cause = _root_os_error(e)
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect: {cause.strerror or cause}" if cause else f"cannot connect: {e}"
    if str(e):
        return f"{type(e).__name__}: {e}"
    cause = _root_os_error(e)                # e.g. ReadError: connection reset by peer
    if cause is None:
        return type(e).__name__
    return f"{type(e).__name__}: {(cause.strerror or str(cause)).lower()}"


def _root_os_error(e: BaseException) -> OSError | None:
    """httpx says "All connection attempts failed"; the OSError underneath says why."""
    seen: set[int] = set()
    found: OSError | None = None
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            found = cur                      # the deepest one carries the errno
        cur = cur.__cause__ or cur.__context__
    return found


def is_connect_error(e: Exception) -> bool:
    """No connection was made (refused, timed out, DNS, TLS): the request never left the
    proxy, so another server may have it. Any other transport error came after the request
    was written: the server had it."""
    return isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)


def client_closed(request_id: str, when: str) -> Response:
    """What a request whose client went away ends with (nobody reads it; metrics and the
    log say 499, nginx's "client closed request")."""
    logger.info("request %s: client closed the connection %s (%d)", request_id, when, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)
