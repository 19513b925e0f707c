"""Scripted fake prefill/decode servers and a real `kvrelay proxy` process, for the proxy tests.

A `FakeBackend` is a FastAPI app served by uvicorn in a thread on a socket it bound itself
(127.0.0.1, a free port). It records every request (path, JSON body, headers) and answers
as kvrelay serve would in its role:
- prefill: a one-token completion plus `kv_transfer_params` (do_remote_prefill true, ...);
- decode: a completion, or an SSE stream when the body says `stream: true`;
- both: `GET /health`, `GET /v1/models`, `POST /v1/kv_transfer/free`,
  `GET /v1/responses/{id}` (a stored response; `?stream=true`: the decode's SSE stream).
`Script` changes the answers (status codes, remote_host, slow/broken streams) per test.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.processes import free_port
from tests.proxy.crashing_backend import read_request

STREAM_TOKENS = ["Paris", ",", " the", " capital", "."]


@dataclass
class Script:
    status: int = 200                    # completions: answer this status (non-200: an error body)
    # prefill: the kv_transfer_params.remote_host it advertises
    remote_host: str | None = "10.1.2.3"
    health: int = 200
    # prefill: normal | slow | break_body; decode: normal | slow_stream | break | break_mid_event
    mode: str = "normal"
    chunk_delay_s: float = 0.08          # decode streams: pause between SSE events
    extra_kv: dict[str, Any] = field(default_factory=dict)   # prefill: more kv_transfer_params keys
    metrics: str | None = None           # GET /metrics: this Prometheus text (None: 404)
    # prefill: answer this many completions busy first (503 "KV hold refused", Retry-After)
    busy_answers: int = 0
    delay_s: float = 0.0                 # prefill: take this long before answering


@dataclass
class Recorded:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    client_port: int = 0                 # the proxy's end of the connection it came on


@dataclass
class FakeBackend:
    role: str                            # "prefill" | "decode"
    script: Script = field(default_factory=Script)
    requests: list[Recorded] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    keep_alive_s: float = 5.0            # uvicorn closes a connection idle this long

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_fake_app(self), log_level="warning",
                                timeout_graceful_shutdown=1, lifespan="off",
                                timeout_keep_alive=self.keep_alive_s)  # type: ignore[arg-type]  # a float works
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    # -- lifecycle
    def start(self) -> FakeBackend:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"fake {self.role} server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5)
        self.sock.close()

    def reset(self) -> None:
        self.script = Script()
        self.requests.clear()
        self.events.clear()

    # -- what it saw
    def completions(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("completions")]

    def frees(self) -> list[Recorded]:
        return [r for r in self.requests if r.path == "/v1/kv_transfer/free"]


def kv_params_of(fake: FakeBackend, request_id: str) -> dict[str, Any]:
    """What a fake prefill returns as kv_transfer_params for this X-Request-Id."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": f"engine-{fake.port}",
            "remote_block_ids": [[1, 2, 3], [7]], "remote_host": fake.script.remote_host,
            "remote_port": 5559, "remote_request_id": f"prefill-{request_id}", "tp_size": 1}


def build_fake_app(fake: FakeBackend) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body() or b"{}")
        fake.requests.append(Recorded(request.url.path, body,
                                      {k.lower(): v for k, v in request.headers.items()},
                                      request.client.port if request.client else 0))
        return body

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=fake.script.health)

    @app.get("/metrics")
    async def metrics() -> Response:
        if fake.script.metrics is None:
            return Response(status_code=404)
        return Response(fake.script.metrics, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": "fake-model", "object": "model", "owned_by": fake.role}]}

    @app.get("/v1/responses/{rid}")
    async def stored(rid: str, request: Request, stream: bool = False) -> Response:
        """A stored response: as JSON, or its events resumed as SSE (`?stream=true`)."""
        await record(request)
        if not stream:
            return JSONResponse({"id": rid, "object": "response", "status": "completed"})
        return StreamingResponse(sse_events(fake, chat=False), media_type="text/event-stream")

    @app.post("/v1/kv_transfer/free")
    async def free(request: Request) -> dict[str, Any]:
        await record(request)
        return {"freed": True}

    async def completion(request: Request, chat: bool) -> Response:
        body = await record(request)
        if fake.script.busy_answers > 0:
            fake.script.busy_answers -= 1
            return JSONResponse({"error": {"message": "KV hold refused: scripted busy prefill; "
                                                      "retry later",
                                           "type": "ServiceUnavailableError", "param": None,
                                           "code": 503}},
                                status_code=503, headers={"Retry-After": "1"})
        if fake.script.status != 200:
            return JSONResponse({"error": {"message": f"scripted {fake.script.status} from "
                                                      f"{fake.role}",
                                           "type": "BadRequestError", "param": None,
                                           "code": fake.script.status}},
                                status_code=fake.script.status)
        if fake.role == "prefill":
            return await prefill_answer(fake, request, body, chat)
        return decode_answer(fake, body, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await completion(request, chat=True)

    return app


def _choice(text: str, chat: bool, finish: str | None) -> dict[str, Any]:
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _completion_json(text: str, chat: bool, tokens: int) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": "fake-model", "choices": [_choice(text, chat, "length")],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}}


async def prefill_answer(fake: FakeBackend, request: Request, body: dict[str, Any],
                         chat: bool) -> Response:
    if fake.script.mode == "break_body":   # the status line and part of the body, then the crash
        async def broken():
            yield b'{"id": "cmpl-fake", '
            await asyncio.sleep(0.05)
            raise RuntimeError("scripted prefill crash mid-answer")
        return StreamingResponse(broken(), media_type="application/json")
    if fake.script.delay_s:
        await asyncio.sleep(fake.script.delay_s)
    if fake.script.mode == "slow":        # holds the request; notes when the proxy gives up on it
        for _ in range(200):
            if await request.is_disconnected():
                fake.events.append("prefill_disconnected")
                return Response(status_code=499)
            await asyncio.sleep(0.05)
    out = _completion_json(STREAM_TOKENS[0], chat, 1)
    out["kv_transfer_params"] = kv_params_of(fake, request.headers.get("x-request-id",
                                                                       "")) | fake.script.extra_kv
    return JSONResponse(out)


def decode_answer(fake: FakeBackend, body: dict[str, Any], chat: bool) -> Response:
    if not body.get("stream"):
        return JSONResponse(_completion_json("".join(STREAM_TOKENS), chat, len(STREAM_TOKENS)))
    return StreamingResponse(sse_events(fake, chat), media_type="text/event-stream")


async def sse_events(fake: FakeBackend, chat: bool):
    fake.events.append("stream_started")
    try:
        count = 10_000 if fake.script.mode == "slow_stream" else len(STREAM_TOKENS)
        for i in range(count):
            if fake.script.mode.startswith("break") and i == 2:
                if fake.script.mode == "break_mid_event":
                    yield 'data: {"choi'
                    await asyncio.sleep(0.05)
                raise RuntimeError("scripted decode crash mid-stream")
            text = STREAM_TOKENS[i % len(STREAM_TOKENS)]
            delta = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            event = {"id": "cmpl-fake",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": "fake-model",
                     "choices": [delta | {"finish_reason": None}]}
            yield f"data: {json.dumps(event)}\n\n"
            await asyncio.sleep(fake.script.chunk_delay_s)
        yield "data: [DONE]\n\n"
        fake.events.append("stream_finished")
    except asyncio.CancelledError:
        fake.events.append("stream_cancelled")
        raise


class NoAnswer:
    """A server that reads each request whole (head, then its Content-Length body), notes its
    X-Request-Id, then closes the connection without a status line: what a server that
    crashed on the request looks like to the proxy. `reset`: close with an RST (SO_LINGER 0)
    instead of a FIN."""

    def __init__(self, reset: bool = False) -> None:
        self.reset = reset
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.received: list[str] = []          # X-Request-Id of every whole request read
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5)
                try:
                    headers, _ = read_request(conn)
                except (OSError, ValueError):
                    continue
                self.received.append(headers.get("x-request-id", ""))
                if self.reset:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


class CrashingBackend:
    """`tests/proxy/crashing_backend.py` (killed by a request containing `crash-me`) in its
    own process on a free 127.0.0.1 port; `stop()` ends it by PID if it still runs."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115  (closed by stop())
        script = Path(__file__).with_name("crashing_backend.py")
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_listening(self, timeout: float = 20) -> CrashingBackend:
        wait_for(lambda: "listening on" in self.log() or self.proc.poll() is not None,
                 timeout, "the crashing backend to listen")
        assert self.proc.poll() is None, self.log()
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def refused_port() -> tuple[socket.socket, int]:
    """A port that refuses connections: bound (so nobody else takes it) but not listening."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


class ProxyProcess:
    """`kvrelay proxy` via `kvrelay.proxy.main.main(argv)` in a subprocess; stopped by PID."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = int(args[args.index("--port") + 1]) if "--port" in args else 8000
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115  (closed by stop())
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("OPENAI_API_KEY", "KVRELAY_API_KEY", "VLLM_API_KEY")}
        full_env |= {"PYTHONUNBUFFERED": "1"} | (env or {})
        code = f"import sys; from kvrelay.proxy.main import main; sys.exit(main({args!r}))"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 30) -> ProxyProcess:
        deadline = time.monotonic() + timeout
        while "Application startup complete." not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError("proxy exited with "
                                   f"{self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy not ready within {timeout}s:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def proxy_args(port: int, prefill_hosts: list[str], prefill_ports: list[int],
               decode_hosts: list[str], decode_ports: list[int]) -> list[str]:
    return ["--port", str(port), "--log-level", "debug",
            "--prefiller-host", *prefill_hosts, "--prefiller-port", *map(str, prefill_ports),
            "--decoder-host", *decode_hosts, "--decoder-port", *map(str, decode_ports)]


def vllm_metrics(running: float = 0, waiting: float = 0, kv_usage: float = 0.0,
                 queries: float = 0, hits: float = 0, blocks_total: float | None = None) -> str:
    """A server's /metrics as the router reads it (vLLM's names)."""
    lines = [f'vllm:num_requests_running{{engine="0"}} {running}',
             f'vllm:num_requests_waiting{{engine="0"}} {waiting}',
             f'vllm:kv_cache_usage_perc{{engine="0"}} {kv_usage}',
             "# TYPE vllm:prefix_cache_queries counter",
             f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}',
             "# TYPE vllm:prefix_cache_hits counter",
             f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}']
    if blocks_total is not None:
        lines.append(f'kvrelay:kv_blocks_total{{engine="0"}} {blocks_total}')
    return "\n".join(lines) + "\n"


def client() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=20)


def wait_for(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def fake_servers(roles: tuple[str, ...]) -> Iterator[list[FakeBackend]]:
    """Fake servers of these roles, started in order and all stopped on the way out."""
    started: list[FakeBackend] = []
    try:
        for role in roles:
            started.append(FakeBackend(role).start())
        yield started
    finally:
        for fake in started:
            fake.stop()
