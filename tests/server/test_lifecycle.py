"""Startup, shutdown, timeouts, API key and CLI errors of `kvrelay serve`."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.processes import Server

TINY_FLAGS = ["--dtype", "float32", "--max-model-len", "64", "--block-size", "4"]


def test_sigterm_drains_in_flight_requests_and_exits_zero(tiny, tmp_path):
    s = Server(str(tiny[0]), TINY_FLAGS, tmp_path / "serve.log")
    try:
        s.wait_ready()
        result = {}

        def long_request():
            result["r"] = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "temperature": 0})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        s.proc.terminate()                              # SIGTERM to the server only
        t.join(60)
        assert s.proc.wait(60) == 0
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 40
    finally:
        s.stop()


def test_health_is_503_until_ready_and_ready_timeout_exits(tiny, tmp_path):
    s = Server(str(tiny[0]), TINY_FLAGS, tmp_path / "serve.log",
               env={"VLLM_ENGINE_READY_TIMEOUT_S": "0.01"})
    try:
        code = s.proc.wait(60)
        assert code == 1
        log = s.log()
        assert "raise VLLM_ENGINE_READY_TIMEOUT_S (or KVRELAY_ENGINE_READY_TIMEOUT_S)" in log
        assert "Application startup complete" not in log
    finally:
        s.stop()


def test_step_timeout_fails_the_request_instead_of_hanging(tiny, tmp_path):
    s = Server(str(tiny[0]), TINY_FLAGS + ["--logits-processors", "tests.server.slow:sleepy"],
               tmp_path / "serve.log", env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1"})
    try:
        s.wait_ready()
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 503
        assert "raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" in r.json()["error"]["message"]
    finally:
        s.stop()


@pytest.fixture(scope="module")
def keyed(tiny, tmp_path_factory):
    """An API key, and steps of 0.2 s (tests.server.slow:drowsy): a 40-token request is
    surely running when its first chunk has arrived, whatever the machine's speed. One
    server for the two tests below: neither changes what the other sees."""
    s = Server(str(tiny[0]), TINY_FLAGS + ["--api-key", "sekret",
                                           "--logits-processors", "tests.server.slow:drowsy"],
               tmp_path_factory.mktemp("keyed") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_client_disconnect_frees_kv_blocks(keyed):
    s = keyed
    generated = s.metrics()["vllm:generation_tokens_total"]
    body = {"prompt": [1, 2, 3], "max_tokens": 40, "stream": True, "ignore_eos": True}
    with (httpx.Client(timeout=30, headers={"Authorization": "Bearer sekret"}) as http,
          http.stream("POST", f"{s.url}/v1/completions", json=body) as r):
        next(r.iter_lines())
        assert s.metrics()["kvrelay:kv_blocks_used"] > 0
    # the connection is closed mid-stream: the engine aborts and frees the blocks
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = s.metrics()
        if m["kvrelay:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0:
            assert m["vllm:generation_tokens_total"] - generated < 40   # cut short, not finished
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks still held after disconnect: {s.metrics()}")


def test_api_key(keyed):
    s = keyed
    assert httpx.get(f"{s.url}/v1/models").status_code == 401
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1], "max_tokens": 1},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1], "max_tokens": 1},
                    headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert httpx.get(f"{s.url}/health").status_code == 200      # health stays open


@pytest.mark.parametrize("args,fragment", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--hf-overrides", "{bad"], "argument --hf-overrides: malformed JSON"),
    (["--additional-config", '{"neuron_config": {"bogus": 1}}'],
     "unknown neuron_config key 'bogus'"),
    (["--additional-config", '{"neuron_config": {"num_seqs_buckets": [4, 2]}}'],
     "must be strictly ascending"),
])
def test_cli_errors_are_one_line(tiny, args, fragment):
    r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", str(tiny[0]), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert fragment in lines[-1], r.stderr


def test_unknown_model_id_fails_with_clear_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "openai/gpt-oss-120b",
                        "--download-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert (f"'openai/gpt-oss-120b' is not a local directory and was not found in {tmp_path}"
            in r.stderr)
