"""What one client's large request costs a live `kvrelay serve` (issue 26): `/health` keeps
answering within 1 s while 30 MB prompts and 32 MB token-id bodies are refused, the API
process's memory grows by a bounded multiple of the body, and a server that is starting
answers every /v1 request 503 + Retry-After, never "maximum context length is 0"."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from tests.processes import Server

MB = 1_000_000


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, kb = line.split()[:2]
            out[name.rstrip(":")] = int(kb) * 1024
    return out


def _reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux: clear_refs 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class HealthPoller:
    """GET /health every 100 ms on its own connection; every answer's latency."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.codes = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                code = client.get(f"{self.url}/health").status_code
                self.latencies.append(time.monotonic() - start)
                self.codes.append(code)
                self._stop.wait(0.1)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _bodies() -> dict[str, tuple[str, bytes]]:
    text = ("w5 " * (30 * MB // 3)).encode()
    ids = b"[" + b", ".join([b"7"] * (8 * MB // 3)) + b"]"
    return {
        "prompt string, 30 MB": ("/v1/completions",
                                 b'{"model": "tiny", "max_tokens": 1, "prompt": "' + text + b'"}'),
        "4 token-id lists of 8 MB": ("/v1/completions", b'{"model": "tiny", "max_tokens": 1, '
                                     b'"prompt": [' + b", ".join([ids] * 4) + b"]}"),
        "chat message, 30 MB": ("/v1/chat/completions",
                                b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": '
                                b'"user", "content": "' + text + b'"}]}'),
    }


def _post(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, timeout=120,
                      headers={"content-type": "application/json"})


def _refused(name: str, r: httpx.Response) -> None:
    assert r.status_code == 400, (name, r.text[:300])
    assert r.json()["error"]["param"] in ("prompt", "messages"), (name, r.text[:300])


def test_health_answers_within_1s_and_memory_stays_bounded_while_huge_bodies_are_refused(
        server):
    pid = server.proc.pid
    bodies = _bodies()
    measured = {}
    with HealthPoller(server.url) as poller:
        time.sleep(0.3)
        # the three at once
        peak_known = _reset_peak(pid)
        before = _status(pid)
        answers: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda n=name, p=path, b=body:
                                    answers.__setitem__(n, _post(server.url, p, b)))
                   for name, (path, body) in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for name in bodies:
            _refused(name, answers[name])
        grown = _status(pid)["VmHWM" if peak_known else "VmRSS"] - before["VmRSS"]
        total = sum(len(body) for _, body in bodies.values())
        print(f"all three at once: {total / 2**20:.0f} MiB of bodies, peak RSS "
              f"+{grown / 2**20:.0f} MiB ({grown / total:.2f}x)")
        # one at a time: what each costs the API process
        for name, (path, body) in bodies.items():
            peak_known = _reset_peak(pid)
            before = _status(pid)
            start = time.monotonic()
            r = _post(server.url, path, body)
            took = time.monotonic() - start
            after = _status(pid)
            _refused(name, r)
            grown = (after["VmHWM"] if peak_known else after["VmRSS"]) - before["VmRSS"]
            measured[name] = (len(body), grown, took)
            print(f"{name}: body {len(body) / 2**20:.1f} MiB, answered in {took:.2f} s, "
                  f"peak RSS +{grown / 2**20:.0f} MiB ({grown / len(body):.2f}x the body), "
                  f"RSS after +{(after['VmRSS'] - before['VmRSS']) / 2**20:.0f} MiB")
        del bodies
        time.sleep(0.3)
        ok = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    worst = max(poller.latencies)
    print(f"/health: {len(poller.latencies)} answers, worst {worst * 1000:.0f} ms, "
          f"median {sorted(poller.latencies)[len(poller.latencies) // 2] * 1000:.0f} ms")
    assert set(poller.codes) == {200} and len(poller.latencies) >= 10
    assert worst < 1.0, f"/health took {worst:.2f} s"         # before issue 26: 29 s
    for name, (size, grown, took) in measured.items():
        # the JSON parse holds three copies at its peak (the body, the body as text, the
        # parsed string: 3.0x for the 30 MB prompt on a fresh server, up to 4x after other
        # large bodies left the allocator fragmented); no tokenizer ran on the whole text.
        # Before issue 26: 156x (4.5 GB) for the prompt, 10x for the token ids.
        assert grown < 5 * size, f"{name}: peak RSS grew {grown / size:.1f}x the body"
        # what stays resident once answered is printed, not asserted: the read's 64 KiB
        # chunks come from glibc's heap, a refused request's traceback holds its body until
        # the cyclic GC runs (measured +0 to +61 MiB; before issue 26 the 30 MB chat message
        # left 2.1 GB resident)
        assert took < 15, f"{name}: answered after {took:.1f} s"


STARTING = {"/v1/completions": {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2},
            "/v1/chat/completions": {"model": "tiny", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "w5"}]}}


def test_requests_while_the_server_starts_are_503_with_retry_after(tiny, tmp_path):
    """Until the engine is ready (and its model length known), every /v1 request is 503 +
    Retry-After with an OpenAI error body; then the same request is served. Both endpoints
    are asked in turn during one start."""
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
                              "--served-model-name", "tiny"], tmp_path / "serve.log")
    answers: dict[str, list[tuple[int, str | None, str]]] = {path: [] for path in STARTING}
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline and any(
                    not seen or seen[-1][0] != 200 for seen in answers.values()):
                try:
                    for path, body in STARTING.items():
                        if answers[path] and answers[path][-1][0] == 200:
                            continue
                        # /v1/models before the request: a 503 answer means the server
                        # was still starting when /v1/models was asked, too
                        models = client.get(f"{s.url}/v1/models")
                        r = client.post(f"{s.url}{path}", content=json.dumps(body),
                                        headers={"content-type": "application/json"})
                        answers[path].append((r.status_code, r.headers.get("retry-after"),
                                              r.text))
                        if r.status_code == 200:
                            assert client.get(f"{s.url}/v1/models").status_code == 200
                            continue
                        assert r.status_code == 503, r.text        # never a 400 while starting
                        assert models.status_code == 503
                        error = r.json()["error"]
                        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
                        assert r.headers["retry-after"] == "2"
                except httpx.TransportError:           # not listening yet
                    pass
                time.sleep(0.05)
        for path, seen in answers.items():
            assert seen and seen[-1][0] == 200, (path, seen[-3:])
            assert any(code == 503 for code, _, _ in seen), f"{path}: never seen starting"
    finally:
        s.stop()
