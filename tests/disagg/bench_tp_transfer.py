"""Measure DI KV transfers with TP on either side: real prefill and decode servers on
127.0.0.1 (UCX over loopback), a test checkpoint large enough for the KV to matter.

    UCX_NET_DEVICES=lo python -m tests.disagg.bench_tp_transfer [--prompt-len 1024] [--requests 4]

For each layout (prefill TP, decode TP) it sends each request's two legs by hand and
reads the decode's metrics: bytes pulled and seconds per load (start of the load to the
last rank's completion, as the engine sees it — includes its polling granularity), and
the decode leg's latency for 1 generated token. Not a test (pytest does not collect it).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from tests.e2e.disagg import kv_config
from tests.factories import add_word_tokenizer, make_hf_model, save_checkpoint
from tests.processes import Server, free_port

# 8 layers (4 full + 4 sliding, window 128), 4 KV heads × 64 dims, float32:
# per token and layer 2 · 4 · 64 · 4 B = 2 KiB
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=384, head_dim=64,
              num_attention_heads=8,
              num_key_value_heads=4, num_hidden_layers=8, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=128, max_position_embeddings=4096)
LAYOUTS = [(1, 1), (1, 2), (2, 2), (2, 4)]


def run(model: Path, a: int, b: int, prompt_len: int, requests: int,
        logs: Path) -> dict[str, float]:
    flags = ["--dtype", "float32", "--max-model-len", str(prompt_len + 64), "--block-size", "16"]
    servers = []
    for role, tp in (("kv_producer", a), ("kv_consumer", b)):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_NET_DEVICES": "lo"}
        servers.append(Server(str(model),
                              flags + ["-tp", str(tp), "--kv-transfer-config", kv_config(role)],
                              logs / f"{role}-tp{a}-{b}.log", env=env))
    prefill, decode = servers
    try:
        for s in servers:
            s.wait_ready(timeout=300)
        latencies = []
        for i in range(requests):
            prompt = [(i * 31 + 7 * j) % 500 + 5 for j in range(prompt_len)]
            first = {"prompt": prompt, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}
            params = httpx.post(f"{prefill.url}/v1/completions", json=first,
                                timeout=600).json()["kv_transfer_params"]
            t0 = time.perf_counter()
            r = httpx.post(f"{decode.url}/v1/completions", timeout=600,
                           json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        m = decode.metrics()
        n = m["kvrelay:kv_transfers_total"]
        return {"loads": n, "MiB/load": m["kvrelay:kv_transfer_bytes_total"] / n / 2**20,
                "ms/load": 1000 * m["kvrelay:kv_transfer_seconds_total"] / n,
                "decode leg ms (median)": 1000 * sorted(latencies)[len(latencies) // 2]}
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_checkpoint(make_hf_model(seed=3, **CONFIG), Path(tmp) / "ckpt")
        add_word_tokenizer(model, CONFIG["vocab_size"])
        for a, b in LAYOUTS:
            print(f"prefill TP{a} → decode TP{b}:",
                  run(model, a, b, args.prompt_len, args.requests, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
