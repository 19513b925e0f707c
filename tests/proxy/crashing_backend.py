"""A prefill server that a hostile request kills, for the proxy's crash-isolation test.

    python tests/proxy/crashing_backend.py PORT

Listens on 127.0.0.1:PORT, one request per connection. A POST whose body contains
`crash-me` is read whole, logged (`POST <X-Request-Id>: crashing`) and the process kills
itself with SIGKILL — abrupt, no answer, no core file — as a server that segfaults on a
request does. Any other POST gets a one-token prefill answer with `kv_transfer_params`,
anything else `{}`. Only the standard library, so it starts in a blink.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

CRASH_MARKER = b"crash-me"


def read_request(conn: socket.socket) -> tuple[dict[str, str], bytes]:
    """One HTTP/1.1 request read whole from `conn` (Content-Length bodies): its headers
    (names lower-cased, plus ":method") and body."""
    with conn.makefile("rb") as f:
        headers = {":method": f.readline().split(b" ", 1)[0].decode("latin-1")}
        while (line := f.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = f.read(length)
    if len(body) != length:
        raise ValueError("the connection closed inside the body")
    return headers, body


def prefill_answer(port: int, request_id: str) -> dict:
    return {"id": "cmpl-crashing-backend", "object": "text_completion", "created": 0,
            "model": "fake-model",
            "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}],
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_engine_id": f"engine-{port}",
                                   "remote_block_ids": [[1]], "remote_host": "127.0.0.1",
                                   "remote_port": 5559,
                                   "remote_request_id": f"prefill-{request_id}", "tp_size": 1}}


def serve(port: int) -> None:
    server = socket.create_server(("127.0.0.1", port))
    print(f"listening on 127.0.0.1:{port}", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                headers, body = read_request(conn)
            except (OSError, ValueError):
                continue
            request_id = headers.get("x-request-id", "")
            answer: dict = {}
            if headers[":method"] == "POST":
                if CRASH_MARKER in body:
                    print(f"POST {request_id}: crashing", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                print(f"POST {request_id}: answered", flush=True)
                answer = prefill_answer(port, request_id)
            payload = json.dumps(answer).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(payload), payload))


if __name__ == "__main__":
    serve(int(sys.argv[1]))
