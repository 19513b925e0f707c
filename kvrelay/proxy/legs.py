"""The two legs of a disaggregated request: the prefill (with its retry rules) and the
opening of the decode; the free notice to a prefill when the decode fails."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response

from kvrelay.proxy import responses
from kvrelay.proxy.answers import copy_response, describe, error_response, is_connect_error
from kvrelay.proxy.body import ClientBody, Payload
from kvrelay.proxy.routing import Backend, free_notice, prefill_edit, routable_kv_params
from kvrelay.proxy.state import FREE_TIMEOUT_S, ProxyState

logger = logging.getLogger("kvrelay.proxy")

BUSY_BACKOFF_S = 0.1             # first wait when every prefill server is busy; doubles
MAX_BUSY_ROUNDS = 12             # rounds over the prefill servers, whatever the time left
FREE_PATH = "/v1/kv_transfer/free"


def no_answer(state: ProxyState, backend: Backend, e: httpx.TransportError,
              request_id: str) -> Response:
    """`backend` took the request, then closed, reset or timed out without a status line.
    It may have acted on it, or the request may be what broke it (a crash): no other server
    gets it, so one request cannot take down every server in turn. The client gets 502."""
    state.failed(backend, "transport")
    logger.warning("request %s: %s server %s took the request and closed the connection "
                   "without answering: %s (not sent to another server)", request_id,
                   backend.role, backend.name, describe(e))
    return error_response(502, f"{backend.role} server {backend.name} closed the connection "
                          f"without answering ({describe(e)}); the request was not sent to "
                          "another server", "BadGatewayError", request_id)


async def _post(backend: Backend, path: str, payload: Payload,
                headers: dict[str, str]) -> httpx.Response:
    """POST `payload` (the client's bytes with the leg's fields spliced in) to `backend`:
    the response with its headers read, its body not yet."""
    assert backend.client is not None
    request = backend.client.build_request(
        "POST", path, content=payload.content(),
        headers={**headers, "Content-Type": "application/json",
                 "Content-Length": str(payload.length)})
    return await backend.client.send(request, stream=True)


@dataclass
class Prefilled:
    backend: Backend
    kv_params: dict[str, Any]       # as the prefill returned them, remote_host made routable
    seconds: float = 0.0


class AnswerBroken(Exception):
    """A backend sent its status line, then the connection broke: it answered, so the
    request is not sent elsewhere."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


async def run_prefill(state: ProxyState, path: str, client_body: ClientBody,
                      headers: dict[str, str], request_id: str,
                      order: list[Backend]) -> Prefilled | Response:
    """Send the prefill request to the servers of `order`, first one first. Only a server the
    proxy could not connect to (`is_connect_error`: the request never left) is replaced by
    the next one: a server that took the request — answered it with any status, or closed
    the connection without answering (`no_answer`: 502) — may have acted on it, and a
    request that makes servers fail must not go round all of them. One exception: a busy
    answer (`_busy`: it kept nothing, and nothing of it reaches the client) goes to the
    next server, and when every server is busy the proxy waits (backoff) and goes round
    again, for at most `state.busy_retry_s` seconds and MAX_BUSY_ROUNDS rounds; then the
    client gets the last busy answer as is."""
    edit = (responses.prefill_edit if path == responses.PATH else prefill_edit)(client_body.fields)
    payload = client_body.payload(*edit)
    failures: list[str] = []
    deadline = time.monotonic() + state.busy_retry_s
    order = list(order)
    for rounds in range(1, MAX_BUSY_ROUNDS + 1):
        busy: tuple[Backend, httpx.Response] | None = None
        for backend in state.takers(list(order), "prefill"):   # not one drained meanwhile
            try:
                resp = await _post_prefill(state, backend, path, payload, headers)
            except httpx.TransportError as e:
                if not is_connect_error(e):
                    return no_answer(state, backend, e, request_id)
                state.failed(backend, "connect")
                logger.warning("request %s: prefill server %s could not be reached: %s",
                               request_id, backend.name, describe(e))
                failures.append(f"{backend.name} ({describe(e)})")
                order = [b for b in order if b is not backend]   # not tried in a later round
                continue
            except AnswerBroken as e:
                state.failed(backend, "transport")
                logger.warning("request %s: prefill server %s broke off its answer: %s",
                               request_id, backend.name, describe(e.error))
                return error_response(502, f"prefill server {backend.name} broke off its answer: "
                                      f"{describe(e.error)}", "BadGatewayError", request_id)
            if _busy(resp) and time.monotonic() < deadline and rounds < MAX_BUSY_ROUNDS:
                state.metrics.busy_retries.labels(backend.name).inc()
                logger.info("request %s: prefill server %s is busy (%d, Retry-After %s): "
                            "trying again elsewhere or later", request_id, backend.name,
                            resp.status_code, resp.headers.get("retry-after"))
                busy = (backend, resp)
                continue
            return _prefill_answer(state, backend, resp, request_id)
        if busy is None:
            break
        wait = min(BUSY_BACKOFF_S * 2 ** (rounds - 1), _retry_after(busy[1]),
                   deadline - time.monotonic())
        if wait <= 0:
            return _prefill_answer(state, *busy, request_id)
        await asyncio.sleep(wait)
    return error_response(503, "no prefill server could take the request: "
                          + ("; ".join(failures) or "none takes requests now"),
                          "ServiceUnavailableError", request_id)


def _busy(resp: httpx.Response) -> bool:
    """A prefill that is busy, not broken: 503 with Retry-After (a kvrelay prefill whose KV
    hold for the decode was refused; it freed the blocks and holds nothing)."""
    return resp.status_code == 503 and "retry-after" in resp.headers


def _retry_after(resp: httpx.Response) -> float:
    try:
        return max(float(resp.headers.get("retry-after", "1")), 0.0)
    except ValueError:                   # an HTTP date: wait the longest backoff step
        return 1.0


def _prefill_answer(state: ProxyState, backend: Backend, resp: httpx.Response,
                    request_id: str) -> Prefilled | Response:
    """The prefill's answer taken as final: count a 5xx, then the result for the client."""
    if resp.status_code >= 500:
        reason = f"http_{resp.status_code}"
        state.metrics.failures.labels(backend.role, backend.name, reason).inc()
        logger.warning("request %s: prefill server %s answered %d (returned as is, not "
                       "retried)", request_id, backend.name, resp.status_code)
    else:
        backend.mark_ok()
    result = _prefill_result(backend, resp, request_id, resp.elapsed.total_seconds())
    if isinstance(result, Prefilled):
        state.hold(backend)          # until the decode leg ends: `let_go` (or `send_free`)
    return result


async def _post_prefill(state: ProxyState, backend: Backend, path: str,
                        payload: Payload, headers: dict[str, str]) -> httpx.Response:
    """The prefill's whole answer. httpx.TransportError: no response came (sent elsewhere
    only when `is_connect_error`); AnswerBroken: the response started, then broke."""
    state.acquire(backend)
    t0 = time.monotonic()
    try:
        resp = await _post(backend, path, payload, headers)
        try:
            await resp.aread()
        except httpx.TransportError as e:
            raise AnswerBroken(e) from e
        finally:
            await resp.aclose()
    finally:
        state.release(backend)
    state.metrics.prefill_latency.labels(backend.name).observe(time.monotonic() - t0)
    return resp


def _prefill_result(backend: Backend, resp: httpx.Response, request_id: str,
                    seconds: float) -> Prefilled | Response:
    if not resp.is_success:
        return copy_response(resp, resp.content, request_id)       # a client mistake: as is
    try:
        kv_params = resp.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        kv_params = None
    if not isinstance(kv_params, dict):
        return error_response(
            502, f"prefill server {backend.name} answered without kv_transfer_params; is it "
            "started with --kv-transfer-config (kv_role kv_producer or kv_both)?",
            "BadGatewayError", request_id)
    return Prefilled(backend, routable_kv_params(kv_params, backend.host), seconds)


@dataclass
class DecodeLeg:
    backend: Backend
    response: httpx.Response        # headers read, body not yet
    started: float


async def open_decode(state: ProxyState, path: str, payload: Payload,
                      headers: dict[str, str],
                      request_id: str, order: list[Backend]) -> DecodeLeg | Response:
    """Send the decode request to the servers of `order`, first one first; as for prefill,
    only a server the proxy could not connect to is replaced by the next one (one that took
    the request and closed without answering: 502)."""
    failures: list[str] = []
    for backend in state.takers(order, "decode"):     # not one drained meanwhile
        state.acquire(backend)
        t0 = time.monotonic()
        try:
            resp = await _post(backend, path, payload, headers)
        except httpx.TransportError as e:         # no response started
            state.release(backend)
            if not is_connect_error(e):              # it had the request: not sent elsewhere
                return no_answer(state, backend, e, request_id)
            state.failed(backend, "connect")
            logger.warning("request %s: decode server %s could not be reached: %s", request_id,
                           backend.name, describe(e))
            failures.append(f"{backend.name} ({describe(e)})")
            continue
        except BaseException:
            state.release(backend)
            raise
        backend.mark_ok()
        return DecodeLeg(backend, resp, t0)
    return error_response(503, "no decode server could take the request: "
                          + ("; ".join(failures) or "none takes requests now"),
                          "ServiceUnavailableError", request_id)


async def send_free(state: ProxyState, prefilled: Prefilled, headers: dict[str, str],
                    request_id: str) -> None:
    """The free notice (best effort); then the request no longer holds the prefill."""
    try:
        await _send_free(state, prefilled, headers, request_id)
    finally:
        state.let_go(prefilled.backend)


async def _send_free(state: ProxyState, prefilled: Prefilled, headers: dict[str, str],
                     request_id: str) -> None:
    body = free_notice(prefilled.kv_params)
    capability = prefilled.kv_params.get("remote_capability")
    if body is not None and capability:       # kvrelay prefills free only with it
        body["remote_capability"] = capability
    backend = prefilled.backend
    if body is None or backend.client is None:
        return
    try:
        resp = await backend.client.post(FREE_PATH, json=body, headers=headers,
                                         timeout=FREE_TIMEOUT_S)
        result = "sent" if resp.is_success else ("not_found" if resp.status_code == 404
                                                 else "rejected")
    except httpx.HTTPError as e:
        result = "error"
        logger.debug("request %s: free notice to %s failed: %s", request_id, backend.name,
                     describe(e))
    state.metrics.free_notices.labels(result).inc()
    logger.debug("request %s: free notice to %s: %s", request_id, backend.name, result)
