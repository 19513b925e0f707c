"""A scripted fake OpenAI server (standing in for a proxy and its decode server) for the
`kvrelay validate` tests.

It answers /health (listing itself as the decode server behind it, as `kvrelay proxy`
does), /v1/models, /v1/completions and /v1/chat/completions (JSON or SSE) and /metrics
(kvrelay's KV-transfer counters, which go up by one per completion while `pull` is on).
`Script` breaks one thing at a time.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class Script:
    health: int = 200
    model: str = "fake-model"
    root: str | None = None            # /v1/models' root (None: the id, as vLLM without a path)
    text: str = " Paris, the capital."
    finish_reason: str | None = "length"
    usage: dict[str, Any] | None = field(default_factory=lambda: {"prompt_tokens": 6,
                                                                  "completion_tokens": 16,
                                                                   "total_tokens": 22})
    chat_status: int = 200
    stream_done: bool = True           # end streams with data: [DONE]
    fail_every: int = 0                # answer 503 to every n-th completion request (0: never)
    list_backends: bool = True         # /health lists this server as the decode server
    metrics: bool = True               # /metrics carries the kvrelay:kv_* counters
    pull: bool = True                  # each completion counts one KV transfer
    handshake_errors: int = 0
    transfer_failures_per_request: int = 0


@dataclass
class FakeServer:
    script: Script = field(default_factory=Script)
    transfers: int = 0
    failures: int = 0
    requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)   # completion and chat requests

    def __post_init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        config = uvicorn.Config(_app(self), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()

    def count(self) -> int | None:
        """One more completion request; returns 503 when the script fails this one."""
        with self.lock:
            self.requests += 1
            n = self.requests
            if self.script.pull:
                self.transfers += 1
            self.failures += self.script.transfer_failures_per_request
        return 503 if self.script.fail_every and n % self.script.fail_every == 0 else None


def _choice(s: Script, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": s.text},
                "finish_reason": s.finish_reason}
    return {"index": 0, "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}


def _events(s: Script, chat: bool):
    for i, word in enumerate(s.text.split(" ")):
        piece = (" " if i else "") + word
        delta = {"delta": {"content": piece}} if chat else {"text": piece}
        yield {"choices": [{"index": 0, **delta, "finish_reason": None}]}
    last = {"delta": {}} if chat else {"text": ""}
    yield {"choices": [{"index": 0, **last, "finish_reason": s.finish_reason}]}
    if s.usage is not None:
        yield {"choices": [], "usage": s.usage}


def _app(fake: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        servers = [{"role": "decode", "server": f"127.0.0.1:{fake.port}", "healthy": True}] \
            if fake.script.list_backends else []
        down = [] if fake.script.health == 200 else [{"role": "prefill", "server": "127.0.0.1:1",
                                                      "healthy": False,
                                                      "error": "connection refused"}]
        return JSONResponse({"status": "ok" if not down else "unavailable", "down": down,
                             "servers": servers},
                            status_code=fake.script.health)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": fake.script.model, "object": "model",
                                            "root": fake.script.root or fake.script.model}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not fake.script.metrics:
            return Response("# no kv metrics\nvllm:num_requests_running 0\n",
                            media_type="text/plain")
        lines = [
            "# TYPE kvrelay:kv_transfers counter",
            f'kvrelay:kv_transfers_total{{engine="0"}} {fake.transfers}',
            "# TYPE kvrelay:kv_transfer_failures counter",
            f'kvrelay:kv_transfer_failures_total{{engine="0"}} {fake.failures}',
            "# TYPE kvrelay:kv_transfer_bytes counter",
            f'kvrelay:kv_transfer_bytes_total{{engine="0"}} {fake.transfers * 4096}',
            "# TYPE kvrelay:kv_handshake_errors counter",
            f'kvrelay:kv_handshake_errors_total{{engine="0"}} {fake.script.handshake_errors}',
            "# TYPE kvrelay:kv_transport_fallback gauge",
            'kvrelay:kv_transport_fallback{engine="0"} 0',
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    async def answer(request: Request, chat: bool) -> Response:
        body = json.loads(await request.body())
        fake.bodies.append(body)
        status = fake.count()
        if chat and fake.script.chat_status != 200:
            status = fake.script.chat_status
        if status is not None:
            return JSONResponse({"error": {"message": "scripted failure",
                                           "type": "ServiceUnavailableError",
                                           "param": None, "code": status}}, status_code=status)
        s = fake.script
        if body.get("stream"):
            def sse():
                for event in _events(s, chat):
                    yield f"data: {json.dumps(event)}\n\n"
                if s.stream_done:
                    yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        out: dict[str, Any] = {"id": "x",
                               "object": "chat.completion" if chat else "text_completion",
                               "model": s.model, "choices": [_choice(s, chat)]}
        if s.usage is not None:
            out["usage"] = s.usage
        return JSONResponse(out)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    return app
