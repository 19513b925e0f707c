"""A tensor-parallel worker that dies brings the server down cleanly."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.processes import Server, alive, descendants


def _await_running(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1:
                return
        time.sleep(0.02)
    raise AssertionError("the request never started running")


def test_killed_worker_fails_requests_and_stops_the_server(tiny, tmp_path):
    s = Server(str(tiny[0]),
               ["--dtype", "float32", "--max-model-len", "4096", "--block-size", "4", "-tp", "2"],
               tmp_path / "serve.log")
    try:
        s.wait_ready()
        family = descendants(s.proc.pid)
        assert len(family) >= 2                          # engine core + one worker (+ helpers)
        result = {}

        def long_request():
            result["r"] = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        _await_running(s.url)   # kill mid-generation (a short request can finish in < 1 s)
        worker = family[-1]                              # the newest: a TP rank
        os.kill(worker, signal.SIGKILL)
        t.join(60)
        assert result["r"].status_code == 503
        assert "tensor-parallel" in result["r"].json()["error"]["message"]
        assert s.proc.wait(60) == 1
        deadline = time.monotonic() + 20
        while any(alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in family if alive(p)], "orphan processes left behind"
        assert "tensor-parallel worker" in s.log()
    finally:
        s.stop()
