"""The benchmark's lean HTTP/1.1 transport against a real socket server (in this process)."""
from __future__ import annotations

import asyncio
import json

import httpx

from kvrelay.bench.client import RequestOptions, send
from kvrelay.bench.datasets import SampleRequest
from kvrelay.bench.transport import StreamingTransport


class _Server:
    """A scripted HTTP/1.1 server: /stream sends chunked SSE events one by one, /json a
    Content-Length body, /fail a 500, /cut closes the connection mid-stream, /once streams
    and then closes the connection unanswered when the next request arrives on it."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        drop_next = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                if drop_next:            # the close of an idle kept-alive connection, racing
                    return               # the client's next request (llama.cpp)
                self.requests.append(head + body)
                path = head.split(b" ")[1]
                drop_next = path == b"/once"
                if not await self._answer(path, body, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, path: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == b"/json":
            data = json.dumps({"echo": json.loads(body)}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(data), data))
            return True
        if path == b"/fail":
            data = b'{"error": {"message": "scripted failure"}}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(data), data))
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        n = json.loads(body)["max_tokens"]
        for i in range(n):
            event = b'data: {"choices": [{"index": 0, "text": "t%d "}]}\n\n' % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.002)
            if path == b"/cut" and i == 1:
                return False
        usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": %d}}' \
                b'\n\ndata: [DONE]\n\n' % n
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(usage), usage))
        await writer.drain()
        return True


async def _with_server(scenario):
    server = _Server()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(transport=StreamingTransport(), trust_env=False) as client:
            result = await scenario(client, f"http://127.0.0.1:{port}")
        await asyncio.sleep(0.05)                  # the handlers see the closed connections
        return server, result
    finally:
        listener.close()


def _req(out: int) -> SampleRequest:
    return SampleRequest("a b c", 3, out)


def test_streams_time_every_chunk_and_reuse_the_connection():
    async def scenario(client, base):
        first = await send(client, base + "/stream", RequestOptions(model="m"), _req(5), 0.0)
        second = await send(client, base + "/stream", RequestOptions(model="m"), _req(3), 0.0)
        return first, second

    server, (first, second) = asyncio.run(_with_server(scenario))
    assert first.success and first.generated_text == "t0 t1 t2 t3 t4 "
    assert (first.output_len, first.prompt_len) == (5, 3)           # the usage chunk was read
    assert len(first.itl) == 4 and len(first.chunk_times) == 5
    assert second.success and second.generated_text == "t0 t1 t2 "
    assert server.connections == 1                                  # kept alive
    head = server.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /stream http/1.1") and b"\r\nhost: 127.0.0.1:" in head


def test_plain_bodies_errors_and_a_cut_stream():
    async def scenario(client, base):
        plain = await client.post(base + "/json", json={"x": 1})
        failed = await send(client, base + "/fail", RequestOptions(model="m"), _req(2), 0.0)
        cut = await send(client, base + "/cut", RequestOptions(model="m"), _req(5), 0.0)
        after = await send(client, base + "/stream", RequestOptions(model="m"), _req(2), 0.0)
        return plain, failed, cut, after

    server, (plain, failed, cut, after) = asyncio.run(_with_server(scenario))
    assert plain.status_code == 200 and plain.json() == {"echo": {"x": 1}}
    assert not failed.success and failed.error == "HTTP 500: scripted failure"
    assert not cut.success and cut.error.startswith("ReadError")
    assert after.success and after.output_len == 2                  # a fresh connection
    assert server.connections == 2


def test_a_refused_connection_is_a_failed_result():
    async def go():
        async with httpx.AsyncClient(transport=StreamingTransport(), trust_env=False) as c:
            return await send(c, "http://127.0.0.1:9/v1/completions", RequestOptions(model="m"),
                              _req(1), 0.0)

    r = asyncio.run(go())
    assert not r.success and r.error.startswith("ConnectError")


def test_a_kept_alive_connection_the_server_closed_is_retried_on_a_fresh_one():
    async def scenario(client, base):
        return [await send(client, base + "/once", RequestOptions(model="m"), _req(2), 0.0)
                for _ in range(4)]

    server, results = asyncio.run(_with_server(scenario))
    assert [r.success for r in results] == [True] * 4, [r.error for r in results]
    assert server.connections == 4 and len(server.requests) == 4    # each answered once
