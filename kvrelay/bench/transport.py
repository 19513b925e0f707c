"""A lean httpx transport for the benchmark's plain-HTTP streams: an asyncio protocol
parsing with httptools (the C parser uvicorn serves with), one connection per request in
flight, kept alive between requests.

Why: httpx's default transport parses each streamed chunk through h11 (pure Python),
httpcore and anyio's stream layers — ~0.5 ms of CPU per chunk, once per token at
concurrency 1. The client shares the cores with the server it measures, so that CPU is
taken from the server (on a 2-core machine it stalls one of the engine's two compute
threads). Here a chunk costs one `data_received` call and one parser callback. Every
server is measured through the same client, so this changes no comparison between them.

https URLs (and anything else this does not speak) go through httpx's own transport.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httptools
import httpx


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.head: asyncio.Future[None] | None = None       # set when the headers are in
        self.body: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None     # the body reader, while it waits
        self.complete = self.keep_alive = False
        self.error: BaseException | None = None
        self.closed = False

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {e}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(httpx.ReadError(f"the server closed the connection{': ' if exc else ''}"
                                       f"{exc or ''}"))

    # -- httptools callbacks --------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()    # reset once the call returns
        self.complete = True
        self._wake()

    # -- the reader's side ----------------------------------------------------------------
    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        self._wake()

    def start(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None, "connected"
        self.parser = httptools.HttpResponseParser(self)
        self.headers, self.status, self.error = [], 0, None
        self.complete = self.keep_alive = False
        self.body.clear()
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.head

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            while self.body:
                yield self.body.popleft()
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: StreamingTransport, key: tuple[str, int], conn: _Connection) -> None:
        self.pool, self.key, self.conn = pool, key, conn

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.conn.chunks():
            yield chunk

    async def aclose(self) -> None:
        self.pool.release(self.key, self.conn)


class StreamingTransport(httpx.AsyncBaseTransport):
    """httpx transport: plain http through `_Connection`s, everything else through httpx's
    default transport (built with `fallback_options`)."""

    def __init__(self, **fallback_options: Any) -> None:
        self.fallback_options = fallback_options
        self.fallback: httpx.AsyncHTTPTransport | None = None   # built on first use: its SSL
        self.idle: dict[tuple[str, int], list[_Connection]] = {}  # context costs ~0.1 s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self.fallback is None:
                self.fallback = httpx.AsyncHTTPTransport(**self.fallback_options)
            return await self.fallback.handle_async_request(request)
        key = (url.host, url.port or 80)
        payload = _serialise(request, await request.aread())
        conn, reused = await self._connection(key, request)
        try:
            await conn.start(payload)
        except httpx.ReadError:
            conn.close()
            if not reused:
                raise
            # A kept-alive connection the server closed while it sat idle (llama.cpp closes
            # them between requests): nothing of the request was answered, so it is sent
            # again on a fresh connection, as httpx's own pool does.
            conn, _ = await self._connection(key, request, fresh=True)
            try:
                await conn.start(payload)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()
            raise
        return httpx.Response(conn.status, headers=conn.headers,
                              stream=_Body(self, key, conn),
                              extensions={"http_version": b"HTTP/1.1"})

    async def _connection(self, key: tuple[str, int], request: httpx.Request,
                          fresh: bool = False) -> tuple[_Connection, bool]:
        """An idle connection to `key` (reused: True) or a new one."""
        idle = None if fresh else self.idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        timeout = request.extensions.get("timeout", {}).get("connect")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, key[0], key[1]), timeout)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(str(e)) from None
        return conn, False

    def release(self, key: tuple[str, int], conn: _Connection) -> None:
        if conn.reusable:
            self.idle.setdefault(key, []).append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()
        if self.fallback is not None:
            await self.fallback.aclose()


def _serialise(request: httpx.Request, body: bytes) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode(), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines) + body
