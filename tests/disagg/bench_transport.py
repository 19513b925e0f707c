"""Measure KV reads between two processes on this machine: the first read after the
handshake, then the steady state, for 64 scattered 16 KiB blocks per read.

    UCX_NET_DEVICES=lo python -m tests.disagg.bench_transport [--iters 200]

Configurations: TCP, NIXL UCX (NIXL's default error handling "peer") and NIXL UCX with
ucx_error_handling_mode "none". Not a test (pytest does not collect it).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from kvrelay.disagg.transport import ReadDesc
from tests.disagg.peer import make, producer, source_tensors

BLOCK = 16 * 1024
NUM_BLOCKS = 256
PER_READ = 64
SHAPE = (NUM_BLOCKS, BLOCK)         # one region: 256 blocks of 16 KiB
DTYPES = (torch.uint8,)


def descs_for(rng: random.Random) -> list[ReadDesc]:
    src = rng.sample(range(NUM_BLOCKS), PER_READ)
    dst = rng.sample(range(NUM_BLOCKS), PER_READ)
    return [ReadDesc(0, s * BLOCK, d * BLOCK, BLOCK) for s, d in zip(src, dst)]


def timed_read(t, descs, notify: bytes, interval: float) -> float:
    t0 = time.perf_counter()
    h = t.start_read("p", descs, notify)
    while t.poll(h) != "done":
        if interval:
            time.sleep(interval)
    dt = time.perf_counter() - t0
    t.release(h)
    return dt


def run(kind: str, options: dict | None, iters: int, interval: float) -> dict:
    rng = random.Random(0)
    with producer(kind, shape=SHAPE, dtypes=DTYPES, options=options) as prod:
        c = make(kind, f"bench-consumer-{os.getpid()}-{kind}", options)
        try:
            dst = torch.zeros(SHAPE, dtype=torch.uint8)
            c.register([dst])
            t0 = time.perf_counter()
            c.add_peer("p", prod.call({"op": "metadata"})["transport"])
            handshake = time.perf_counter() - t0
            first = timed_read(c, descs_for(rng), b"first", interval)
            lat = []
            for i in range(iters):
                descs = descs_for(rng)
                lat.append(timed_read(c, descs, b"i%d" % i, interval))
            src = source_tensors(SHAPE, DTYPES)[0]
            for d in descs:                                   # the last read landed exactly
                s, e = d.local_offset // BLOCK, d.remote_offset // BLOCK
                assert torch.equal(dst[s], src[e])
            prod.notifications(want=b"i%d" % (iters - 1))
        finally:
            c.close()
    med = statistics.median(lat)
    total = PER_READ * BLOCK
    return {"handshake_ms": handshake * 1e3, "first_ms": first * 1e3, "median_ms": med * 1e3,
            "p90_ms": sorted(lat)[int(0.9 * len(lat))] * 1e3, "GBps_median": total / med / 1e9,
            "GBps_mean": total * len(lat) / sum(lat) / 1e9, "us_per_desc": med / PER_READ * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--interval", type=float, default=0.0, help="sleep between polls (s)")
    ap.add_argument("--only", default=None, help="tcp | nixl | nixl-none")
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    configs = [("tcp", "tcp", None), ("nixl", "nixl (UCX, error mode peer)", None),
               ("nixl-none", "nixl (UCX, error mode none)",
                {"UCX": {"ucx_error_handling_mode": "none"}})]
    print(f"{PER_READ} scattered blocks of {BLOCK // 1024} KiB per read ({PER_READ * BLOCK >> 20} "
          f"MiB), {args.iters} reads, poll interval {args.interval}s")
    for key, label, opts in configs:
        if args.only and args.only != key:
            continue
        r = run("tcp" if key == "tcp" else "nixl", opts, args.iters, args.interval)
        print(f"{label:30s} handshake {r['handshake_ms']:7.2f} ms  first read {r['first_ms']:7.2f} "
              f"ms  median {r['median_ms']:6.3f} ms (p90 {r['p90_ms']:6.3f})  "
              f"{r['GBps_median']:5.2f} GB/s median, {r['GBps_mean']:5.2f} mean  "
              f"{r['us_per_desc']:5.1f} us/desc", flush=True)


if __name__ == "__main__":
    main()
