"""Helpers to stand up prefill/decode servers (and the proxy) for DI tests."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.processes import Server, free_port

COMMON = ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4"]


def kv_config(role: str, backend: str = "UCX", **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cuda",
                       "kv_connector_extra_config": {"backends": [backend], **extra}})


def start(model: str, role: str, log: Path, backend: str = "UCX", flags: list[str] | None = None,
          env: dict[str, str] | None = None, **extra) -> Server:
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_NET_DEVICES": "lo"} | (env or {})
    return Server(model, COMMON + (flags or []) + ["--kv-transfer-config",
                                                   kv_config(role, backend, **extra)],
                  log, env=env)


def prefill_then_decode(prefill: Server, decode: Server, body: dict,
                        request_id: str) -> tuple[dict, dict]:
    """The proxy's two legs by hand (the brief's wire format)."""
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    first.pop("min_tokens", None)
    r = httpx.post(f"{prefill.url}/v1/completions", json=first, timeout=60,
                   headers={"X-Request-Id": request_id})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    second = dict(body, kv_transfer_params=params)
    d = httpx.post(f"{decode.url}/v1/completions", json=second, timeout=60,
                   headers={"X-Request-Id": request_id})
    return params, d


def wait_metric(server: Server, name: str, value: float, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m.get(name) == value or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
