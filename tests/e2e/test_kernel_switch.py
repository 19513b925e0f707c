"""`kvrelay serve` with an empty kernel cache answers at once on the PyTorch reference paths
while the native kernels build, switches to them between two steps, and answers the same
tokens before, across and after the switch (engine/native_switch.py).

The build here is another process's: the test holds the build directory's lock, as a server
started during another one's build finds it, and puts the library (this session's build)
in place before it lets go — seconds instead of the minutes a real compile takes
(benchmarks/cold_start.py times that one)."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from filelock import FileLock

from kvrelay.model import kernels
from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
from tests.processes import Server

PROMPTS = ("w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w40 w2")
LONG = 400          # tokens: hundreds of steps, so the switch usually falls inside them


@pytest.fixture
def held_build(tmp_path):
    """(kernels root, the build directory, its lock held by this process, the library
    to put in place)."""
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    status = kernels.status()
    assert status.available, status.reason
    directory = tmp_path / "kernels" / kernels.build_dir().name
    directory.mkdir(parents=True)
    lock = FileLock(str(directory / "build.flock"))
    lock.acquire()
    yield tmp_path / "kernels", directory, lock, Path(str(status.library))
    if lock.is_locked:
        lock.release()


def complete(server: Server, prompt: str, max_tokens: int = 24) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream(server: Server, prompt: str, max_tokens: int, first_chunk: threading.Event,
           out: list[str]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:])["choices"][0]["text"])
                first_chunk.set()
    first_chunk.set()


def wait_for_switch(server: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics().get("kvrelay:native_kernels_ready") != 1.0:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.2)


def test_serves_before_the_build_and_answers_the_same_after_the_switch(tiny, held_build,  # noqa: F811
                                                                      tmp_path):
    root, directory, lock, library = held_build
    server = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "512",
                                   "--block-size", "4", "--served-model-name", "tiny"],
                    tmp_path / "serve.log", env={"KVRELAY_KERNELS_DIR": str(root)})
    try:
        server.wait_ready()
        # the kernels are not there: the reference paths serve
        metrics = server.metrics()
        assert metrics["kvrelay:native_kernels_building"] == 1.0
        assert metrics["kvrelay:native_kernels_ready"] == 0.0
        assert metrics["kvrelay:native_kernels_available"] == 0.0
        assert "waiting for another process building the native kernels" in server.log()
        before = [complete(server, p) for p in PROMPTS]
        long_before = complete(server, PROMPTS[1], max_tokens=LONG)

        # a long request streams while the build finishes and the engine switches
        chunks: list[str] = []
        started = threading.Event()
        client = threading.Thread(target=stream, args=(server, PROMPTS[1], LONG, started,
                                                       chunks))
        client.start()
        assert started.wait(60)
        shutil.copy2(library, directory / library.name)
        lock.release()
        wait_for_switch(server)
        streamed_at_switch = len(chunks)
        client.join(60)

        after = [complete(server, p) for p in PROMPTS]
        long_after = complete(server, PROMPTS[1], max_tokens=LONG)
        metrics = server.metrics()
        assert metrics["kvrelay:native_kernels_building"] == 0.0
        assert metrics["kvrelay:native_kernels_available"] == 1.0
        log = server.log()
        assert "native kernels ready after" in log and "native CPU kernels unavailable" not in log
    finally:
        server.stop()
    assert after == before
    # usually streaming when the switch came (the test sees it up to ~0.3 s late, so that is
    # not asserted: tests/engine/test_native_switch.py switches mid-request deterministically)
    assert len(chunks) == LONG and streamed_at_switch > 0
    assert "".join(chunks) == long_before == long_after
