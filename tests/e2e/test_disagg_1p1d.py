"""1P1D on 127.0.0.1: prefill (kv_producer) and decode (kv_consumer) servers, KV pulled
over NIXL (UCX) or TCP; greedy output equals a single instance's."""
from __future__ import annotations

import time

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from tests.e2e.disagg import prefill_then_decode, start, wait_metric
from tests.factories import greedy_mismatch
from tests.processes import stop_all

# block size 4, sliding window 8: lengths hit every residue mod 4 around the window edge,
# shorter than a block, and longer than the window
PROMPT_LENS = [1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 30]
MAX_TOKENS = 6


def _prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 150 + 5 for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    outs = llm.generate([_prompt(n) for n in PROMPT_LENS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {n: o.outputs[0].token_ids for n, o in zip(PROMPT_LENS, outs)}


@pytest.fixture(scope="module", params=["UCX", "TCP"])
def pair(request, tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"1p1d-{request.param}")
    prefill = start(str(tiny[0]), "kv_producer", logs / "prefill.log", request.param, lease_s=3)
    decode = start(str(tiny[0]), "kv_consumer", logs / "decode.log", request.param)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        stop_all([prefill, decode])


def test_greedy_equals_single_instance(tiny, pair, reference):
    prefill, decode = pair
    for n in PROMPT_LENS:
        body = {"prompt": _prompt(n), "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        params, d = prefill_then_decode(prefill, decode, body, f"req-{n}")
        assert d.status_code == 200, d.text
        # the engine's id: the client's (X-Request-Id) plus a suffix that keeps it unique
        assert params["remote_request_id"].startswith(f"cmpl-req-{n}-0-") and params["tp_size"] == 1
        assert len(params["remote_block_ids"]) == 2                      # full + sliding groups
        tokens = [t for lp in d.json()["choices"][0]["logprobs"]["top_logprobs"] for t in lp]
        assert len(tokens) == MAX_TOKENS
        got = _token_ids(tiny, d.json())
        if got != reference[n]:
            assert greedy_mismatch(tiny[1], _prompt(n), got) is None, f"prompt length {n}"
    m = decode.metrics()
    assert m["kvrelay:kv_transfers_total"] >= len([n for n in PROMPT_LENS if n > 1]) - 1
    assert m["kvrelay:kv_transfer_bytes_total"] > 0 and m["kvrelay:kv_transfer_failures_total"] == 0
    # every read-done notice reached the prefill: it holds nothing
    m = wait_metric(prefill, "kvrelay:kv_blocks_used", 0)
    assert m["kvrelay:kv_blocks_used"] == 0 and m["kvrelay:kv_requests_held_for_remote"] == 0


def _token_ids(tiny, body: dict) -> list[int]:
    # the word tokenizer maps "wN" ↔ N
    return [int(t.strip().removeprefix("w")) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_streaming_and_n(tiny, pair, reference):
    prefill, decode = pair
    body = {"prompt": _prompt(11), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = httpx.post(f"{prefill.url}/v1/completions", json=first,
                        timeout=60).json()["kv_transfer_params"]
    with httpx.stream("POST", f"{decode.url}/v1/completions", timeout=60,
                      json=dict(body, stream=True, n=2, kv_transfer_params=params)) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")
                 and line != "data: [DONE]"]
    import json
    texts = {0: "", 1: ""}
    for line in lines:
        for c in json.loads(line[6:])["choices"]:
            texts[c["index"]] += c["text"]
    want = " " + " ".join(f"w{t}" for t in reference[11])
    assert texts[0] == texts[1] == want


@pytest.mark.parametrize("pair", ["UCX"], indirect=True)
def test_lease_frees_blocks_when_decode_never_comes(pair):
    """One transport: the lease is the prefill's scheduler's, whatever carries the KV (and the
    test waits it out: 3 s)."""
    prefill, _ = pair
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "prompt": _prompt(20), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200
    assert prefill.metrics()["kvrelay:kv_requests_held_for_remote"] == 1
    m = wait_metric(prefill, "kvrelay:kv_requests_held_for_remote", 0, timeout=15)
    assert m["kvrelay:kv_requests_held_for_remote"] == 0 and m["kvrelay:kv_blocks_used"] == 0
    assert m["kvrelay:kv_leases_expired_total"] >= 1


def test_explicit_free(pair):
    prefill, _ = pair
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "prompt": _prompt(20), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = r.json()["kv_transfer_params"]
    assert prefill.metrics()["kvrelay:kv_blocks_used"] > 0
    assert httpx.post(f"{prefill.url}/v1/kv_transfer/free", json={
        "remote_request_id": params["remote_request_id"],
        "remote_capability": params["remote_capability"]}).status_code == 200
    m = wait_metric(prefill, "kvrelay:kv_blocks_used", 0, timeout=5)
    assert m["kvrelay:kv_blocks_used"] == 0


@pytest.mark.parametrize("pair", ["UCX"], indirect=True)
def test_handshake_mismatch_is_a_clear_error(tiny, pair, tmp_path):
    """One transport: the handshake is the side channel's, before any transport is used
    (the mismatched decode here is a UCX one either way), and it costs a server start."""
    prefill, _ = pair
    other = start(str(tiny[0]), "kv_consumer", tmp_path / "decode8.log",
                  flags=["--block-size", "8"])
    try:
        other.wait_ready()
        r = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
            "prompt": _prompt(20), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json()["kv_transfer_params"]
        d = httpx.post(f"{other.url}/v1/completions", timeout=60, json={
            "prompt": _prompt(20), "max_tokens": 3, "kv_transfer_params": params})
        assert d.status_code == 502
        message = d.json()["error"]["message"]
        assert "incompatible KV cache: block_size: prefill 4, decode 8" in message
        deadline = time.monotonic() + 5
        while "incompatible KV cache" not in prefill.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "block_size: prefill 4, decode 8" in prefill.log()
        httpx.post(f"{prefill.url}/v1/kv_transfer/free", json={
            "remote_request_id": params["remote_request_id"],
            "remote_capability": params["remote_capability"]})
    finally:
        other.stop()
