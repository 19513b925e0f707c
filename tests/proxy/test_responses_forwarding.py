"""The proxy forwards a stored response's cancel and streamed GET to the decode server that
holds it: `POST /v1/responses/{id}/cancel`, and `GET /v1/responses/{id}?stream=true&
starting_after=N` with its query, relayed as SSE as it comes (a resumed background stream).
The proxy app runs in this process (TestClient), a fake decode server in a thread."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from kvrelay.proxy.app import build_app
from kvrelay.proxy.policy import RoutingSettings
from tests.proxy.fakes import FakeBackend

RID = "resp_held"


class FakeDecode:
    """A decode server's stored-response routes: records what it was asked."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []          # (method, path, query)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/responses/{rid}")
        async def get(rid: str, request: Request, stream: bool = False,
                      starting_after: int = -1):
            self.seen.append(("GET", request.url.path, request.url.query))
            if not stream:
                return {"id": rid, "object": "response", "status": "in_progress"}
            if starting_after > 5:
                return JSONResponse({"error": {"message": "too far", "type": "BadRequestError",
                                               "param": "starting_after", "code": 400}}, 400)

            async def events():
                for seq in range(starting_after + 1, 4):
                    yield f"event: e\ndata: {json.dumps({'sequence_number': seq})}\n\n"
                    await asyncio.sleep(0.05)
            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/responses/{rid}/cancel")
        async def cancel(rid: str, request: Request):
            self.seen.append(("POST", request.url.path, request.url.query))
            return {"id": rid, "object": "response", "status": "cancelled"}
        return app

    def start(self) -> FakeDecode:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def decode():
    prefill, fake = FakeBackend("prefill").start(), FakeDecode().start()
    try:
        yield prefill, fake
    finally:
        fake.stop()
        prefill.stop()


@pytest.fixture
def proxy(decode):
    prefill, fake = decode
    fake.seen.clear()
    app = build_app([("127.0.0.1", prefill.port)], [("127.0.0.1", fake.port)],
                    health_interval_s=0, routing=RoutingSettings(routing="round_robin"))
    with TestClient(app) as client:
        state = app.state.proxy
        state.homes.remember(RID, state.decode[0])      # as if it had relayed its creation
        yield client, fake


def test_cancel_goes_to_the_decode_server_that_holds_it(proxy):
    client, fake = proxy
    r = client.post(f"/v1/responses/{RID}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert fake.seen == [("POST", f"/v1/responses/{RID}/cancel", "")]
    r = client.post("/v1/responses/resp_unknown/cancel")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_a_streamed_get_keeps_its_query_and_is_relayed_as_sse(proxy):
    client, fake = proxy
    with client.stream("GET", f"/v1/responses/{RID}?stream=true&starting_after=1") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    seqs = [json.loads(line[5:])["sequence_number"] for line in body.splitlines()
            if line.startswith("data:")]
    assert seqs == [2, 3]
    assert fake.seen == [("GET", f"/v1/responses/{RID}", "stream=true&starting_after=1")]
    # the plain GET stays JSON; the decode server's 400 comes back as it is
    assert client.get(f"/v1/responses/{RID}").json()["status"] == "in_progress"
    r = client.get(f"/v1/responses/{RID}?stream=true&starting_after=9")
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
