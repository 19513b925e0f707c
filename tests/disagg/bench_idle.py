"""Idle CPU of a NIXL prefill and decode server, then a short 1P1D run. Not a test.

    python -m tests.disagg.bench_idle [--idle-s 20] [--requests 20]     (UCX_TLS=tcp: tcp)

Starts `kvrelay serve` twice on a tiny float32 checkpoint (kv_producer, kv_consumer, UCX,
UCX_NET_DEVICES=lo), sends one warm-up request, then reports each server's CPU (utime +
stime of it and its engine process, /proc/PID/stat) per wall second over --idle-s, and the
wall time of --requests prefill-then-decode requests with the decode's mean KV load time
(kvrelay:kv_transfer_seconds / kvrelay:kv_transfers).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from tests.e2e.disagg import prefill_then_decode, start
from tests.factories import add_word_tokenizer, make_hf_model, save_checkpoint
from tests.processes import Server, descendants

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def counter(m: dict[str, float], name: str) -> float:
    return m.get(f"{name}_total", m.get(name, 0.0))


def run(prefill: Server, decode: Server, idle_s: float, requests: int) -> None:
    body = {"prompt": [5 + i % 150 for i in range(60)], "max_tokens": 2, "temperature": 0}
    prefill_then_decode(prefill, decode, body, "warm-up")
    time.sleep(2)
    before = cpu_seconds(prefill.proc.pid), cpu_seconds(decode.proc.pid)
    t0 = time.monotonic()
    time.sleep(idle_s)
    dt = time.monotonic() - t0
    after = cpu_seconds(prefill.proc.pid), cpu_seconds(decode.proc.pid)
    print(f"idle {dt:.0f} s: prefill {(after[0] - before[0]) / dt:.3f} core, decode "
          f"{(after[1] - before[1]) / dt:.3f} core")
    m0, t0 = decode.metrics(), time.monotonic()
    for i in range(requests):
        body = {"prompt": [5 + (i * 7 + j) % 150 for j in range(80)], "max_tokens": 2,
                "temperature": 0}
        _, d = prefill_then_decode(prefill, decode, body, f"r{i}")
        assert d.status_code == 200, d.text
    wall = time.monotonic() - t0
    m1 = decode.metrics()
    loads = counter(m1, "kvrelay:kv_transfers") - counter(m0, "kvrelay:kv_transfers")
    secs = counter(m1, "kvrelay:kv_transfer_seconds") - counter(m0, "kvrelay:kv_transfer_seconds")
    nbytes = counter(m1, "kvrelay:kv_transfer_bytes") - counter(m0, "kvrelay:kv_transfer_bytes")
    print(f"1P1D {requests} requests (80-token prompts, 2 tokens): {wall:.2f} s wall, "
          f"{loads:.0f} KV loads of {nbytes / max(loads, 1) / 1024:.0f} KiB, mean load "
          f"{secs / max(loads, 1) * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvrelay-bench-idle-"))
    hf = make_hf_model(seed=11, num_hidden_layers=4, sliding_window=8)
    path = save_checkpoint(hf, tmp / "ckpt")
    add_word_tokenizer(path, 160, eos_id=3)
    env = {"UCX_TLS": os.environ["UCX_TLS"]} if os.environ.get("UCX_TLS") else {}
    prefill = start(str(path), "kv_producer", tmp / "prefill.log", "UCX", env=env, lease_s=30)
    decode = start(str(path), "kv_consumer", tmp / "decode.log", "UCX", env=env)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        run(prefill, decode, args.idle_s, args.requests)
    finally:
        prefill.stop()
        decode.stop()


if __name__ == "__main__":
    main()
