"""Issue 26: one hostile request must not take down every prefill of a proxy. Two real
prefill processes that die (SIGKILL, at once, no answer) on a request containing
`crash-me` (tests/proxy/crashing_backend.py) behind a real `kvrelay proxy`: before the fix
the proxy re-sent the request to the next prefill and both died within a third of a
second; now the client gets a 502, one process dies, and the other keeps serving."""
from __future__ import annotations

import signal

from tests.processes import free_port
from tests.proxy.fakes import CrashingBackend, FakeBackend, ProxyProcess, client, proxy_args
from tests.proxy.test_hardening import assert_openai_error

LOCAL = "127.0.0.1"


def test_a_request_that_crashes_a_prefill_crashes_only_that_one(tmp_path):
    prefills = [CrashingBackend(tmp_path / f"prefill{i}.log") for i in range(2)]
    decode = FakeBackend("decode").start()
    proxy: ProxyProcess | None = None
    try:
        for p in prefills:
            p.wait_listening()
        proxy = ProxyProcess(proxy_args(free_port(), [LOCAL], [p.port for p in prefills],
                                        [LOCAL], [decode.port]) + ["--health-interval", "0"],
                             tmp_path / "proxy.log").wait_ready()
        with client() as c:
            r = c.post(f"{proxy.url}/v1/completions",
                       json={"prompt": "crash-me", "max_tokens": 3},
                       headers={"X-Request-Id": "hostile"})
            error = assert_openai_error(r, 502, "BadGatewayError")
            assert "closed the connection without answering" in error["message"]
            [dead] = [p for p in prefills if "POST hostile: crashing" in p.log()]
            [survivor] = [p for p in prefills if p is not dead]
            assert dead.proc.wait(10) == -signal.SIGKILL
            assert survivor.proc.poll() is None and "POST" not in survivor.log()
            assert decode.completions() == []
            # the proxy keeps serving on the survivor (the dead one is tried last for 5 s)
            for i in range(2):
                r = c.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "max_tokens": 3},
                           headers={"X-Request-Id": f"honest-{i}"})
                assert r.status_code == 200, r.text
        assert survivor.log().count(": answered") == 2
        assert [d.headers["x-request-id"] for d in decode.completions()] == ["honest-0",
                                                                             "honest-1"]
    finally:
        if proxy is not None:
            proxy.stop()
        decode.stop()
        for p in prefills:
            p.stop()
