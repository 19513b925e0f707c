"""NIXL progress without NIXL's own progress thread: an idle agent costs (almost) no CPU,
and reads still complete where the serving side must progress (UCX over tcp)."""
from __future__ import annotations

import time

import torch

from kvrelay.disagg.nixl import NixlTransport
from tests.disagg.conftest import needs_nixl
from tests.disagg.peer import DTYPES, SHAPE, make, producer, source_tensors
from tests.disagg.test_transport import desc, read

IDLE_S = 2.0
MAX_IDLE_CORE = 0.05      # NIXL 1.5.1's progress thread: 0.15-0.4 of a core, even under load


def cpu_share(seconds: float) -> float:
    """This process's CPU time (every thread) per wall second over `seconds` of sleep."""
    c0, t0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.monotonic() - t0)


@needs_nixl
def test_idle_nixl_transport_costs_no_cpu():
    baseline = cpu_share(0.5)          # this process without the agent (should be ~0)
    t = NixlTransport("idle-cpu-test", backends=["UCX"])
    try:
        t.register([torch.zeros(1 << 16, dtype=torch.uint8)])
        t.metadata()
        idle = cpu_share(IDLE_S)
        assert idle < baseline + MAX_IDLE_CORE, \
            f"an idle NIXL transport used {idle:.2f} of a core (baseline {baseline:.2f})"
        t.expect_reads(True)           # holds outstanding: the pump runs, at a bounded rate
        time.sleep(0.2)
        t.expect_reads(False)          # released: back to sleep
        time.sleep(0.1)
        idle = cpu_share(IDLE_S)
        assert idle < baseline + MAX_IDLE_CORE, \
            f"after reads stopped being expected: {idle:.2f} of a core"
    finally:
        t.close()


@needs_nixl
def test_ucx_tcp_reads_complete_without_progress_thread(monkeypatch):
    """UCX serves a tcp GET only when the producer progresses its worker: the producer
    (tests/disagg/peer.py) never asks for notifications here, its pump must do it."""
    monkeypatch.setenv("UCX_TLS", "tcp")          # both processes (the producer inherits it)
    src = source_tensors()
    with producer("nixl") as prod:
        consumer = make("nixl", "consumer-tcp")
        try:
            dst = [torch.zeros(SHAPE, dtype=dt) for dt in DTYPES]
            consumer.register(dst)
            consumer.add_peer("p", prod.call({"op": "metadata"})["transport"])
            descs = [desc(src[0], 0, kv, s, d) for kv in (0, 1) for s, d in [(3, 1), (9, 4)]]
            t0 = time.monotonic()
            read(consumer, descs, notify=b"tcp-read", peer="p")
            took = time.monotonic() - t0
            for kv in (0, 1):
                assert torch.equal(dst[0][kv, 1], src[0][kv, 3])
                assert torch.equal(dst[0][kv, 4], src[0][kv, 9])
            assert b"tcp-read" in prod.notifications(want=b"tcp-read")
            assert took < 10, f"a 4-block read over UCX tcp took {took:.1f}s"
        finally:
            consumer.close()
    assert prod.proc.exitcode == 0
