"""`kvrelay deploy`'s bring-up status: each process's step read from its log (starting,
loading the weights, warming up, ready …), a line when it changes and a periodic summary."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from kvrelay.deploy import launcher
from kvrelay.deploy.launcher import Component, Deployment, status_line

# a kvrelay serve log, as the embedded model writes it
SERVE_LOG = [
    "INFO kvrelay.server: serving /m as m on http://127.0.0.1:8100\n",
    "INFO:     Started server process [1]\nINFO:     Waiting for application startup.\n",
    "INFO kvrelay.model.embedded: building the embedded model kvrelay/smollm2-135m-gpt-oss\n",
    "Loading weights:   0%|          | 0/32 [00:00<?, ?part/s]Loading weights: 100%|\n",
    "INFO 2026-12-07 kvrelay.model.loader: loaded /m: 30 layers\n",
    "INFO 2026-12-07 kvrelay.engine.runner: KV cache: 1456 blocks of 16 tokens\n",
    "INFO:     Application startup complete.\n",
]
STEPS = ["starting up", "building the embedded model", "loading the weights",
         "allocating the KV cache", "warming up", "ready"]


def component(tmp_path: Path, name: str) -> Component:
    c = Component(name, (), {}, tmp_path / f"{name}.log")
    c.log_path.write_text("")
    c.started_at = time.monotonic()
    return c


def test_the_step_follows_the_log(tmp_path):
    c = component(tmp_path, "decode-0")
    assert c.step == "starting" and not c.check_ready()
    seen = []
    for chunk in SERVE_LOG:
        with open(c.log_path, "a") as f:
            f.write(chunk)
        if c.update_step():
            seen.append(c.step)
    assert seen == STEPS
    assert c.check_ready()


def test_a_line_written_in_two_pieces_is_found_and_steps_never_go_back(tmp_path):
    c = component(tmp_path, "prefill-0")
    with open(c.log_path, "a") as f:
        f.write("x" * 5000 + "INFO kvrelay.engine.runner: KV ca")
    assert not c.update_step() and c.step == "starting"
    with open(c.log_path, "a") as f:
        f.write("che: 10 blocks\n")
    assert c.update_step() and c.step == "warming up"
    with open(c.log_path, "a") as f:       # a background kernel build reporting late
        f.write("INFO kvrelay.model.kernels: building the native kernels in /k\n")
    assert not c.update_step() and c.step == "warming up"


def test_status_line_names_every_process_and_its_step(tmp_path):
    a, b = component(tmp_path, "decode-0"), component(tmp_path, "prefill-0")
    a.steps.step = "warming up"
    assert status_line([a, b], 30.4) == "waiting 30s: decode-0 warming up, prefill-0 starting"


def test_await_ready_says_each_step_and_where_everyone_is(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "STATUS_EVERY_S", 0.3)
    logs = [component(tmp_path, "decode-0"), component(tmp_path, "prefill-0")]
    deployment = Deployment.__new__(Deployment)       # no plan: only await_ready is used

    def write() -> None:
        for chunk in SERVE_LOG:
            for c in logs:
                with open(c.log_path, "a") as f:
                    f.write(chunk)
            time.sleep(0.3)

    writer = threading.Thread(target=write)
    writer.start()
    said: list[str] = []
    try:
        assert deployment.await_ready(logs, 30, threading.Event(), said.append)
    finally:
        writer.join()
    for name in ("decode-0", "prefill-0"):
        steps = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in said
                 if line.startswith(f"{name}: ")]
        assert steps[-1] == "ready" and steps == [s for s in STEPS if s in steps], said
        assert len(steps) >= 2, said               # polled every 0.25 s, written every 0.3 s
    assert any(line.startswith("waiting ") and "decode-0 " in line and "prefill-0 " in line
               for line in said), said
