"""Disaggregated serving with tensor parallelism on either side (prefill TP a, decode TP b,
b a multiple of a): each rank has its own transport and reads its KV heads from the
prefill rank that owns them. Greedy output equals a single instance's; the decode pulled
exactly the prompt's KV (no silent recompute); the prefill holds nothing afterwards;
prefill TP 2 → decode TP 1 is refused on both sides, naming the sizes."""
from __future__ import annotations

import time

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.disagg.loads import needed_blocks
from tests.e2e.disagg import prefill_then_decode, start, wait_metric
from tests.factories import greedy_mismatch
from tests.processes import stop_all

PROMPT_LENS = [2, 5, 9, 12, 30]
MAX_TOKENS = 5
BLOCK, WINDOW = 4, 8
# tiny checkpoint: 4 layers (hybrid: 2 full + 2 sliding), 2 KV heads × 16 dims, float32
BYTES_PER_BLOCK_LAYER = 2 * 2 * BLOCK * 16 * 4


def _prompt(n: int, salt: int) -> list[int]:
    """Distinct first tokens per salt: no prefix-cache hits between requests."""
    return [salt % 150 + 5] + [(7 * i + 3 + salt) % 150 + 5 for i in range(1, n)]


def _expected_bytes(n: int) -> int:
    """KV decode must pull for a prompt of n tokens (all KV heads, summed over ranks)."""
    blocks = len(needed_blocks(None, 0, n, BLOCK)) * 2 + len(needed_blocks(WINDOW, 0, n, BLOCK)) * 2
    return blocks * BYTES_PER_BLOCK_LAYER


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """prefill TP1, prefill TP2 and decode TP2 (UCX over loopback); started together."""
    logs = tmp_path_factory.mktemp("di-tp")
    made = {
        "prefill1": start(str(tiny[0]), "kv_producer", logs / "prefill-tp1.log"),
        "prefill2": start(str(tiny[0]), "kv_producer", logs / "prefill-tp2.log",
                          flags=["-tp", "2"]),
        "decode2": start(str(tiny[0]), "kv_consumer", logs / "decode-tp2.log", flags=["-tp", "2"]),
    }
    try:
        for s in made.values():
            s.wait_ready(timeout=300)
        yield made
    finally:
        stop_all(list(made.values()))


def _reference(tiny, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=BLOCK)
    outs = llm.generate(prompts,
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _token_ids(body: dict) -> list[int]:
    return [int(t.strip().removeprefix("w")) for t in body["choices"][0]["logprobs"]["tokens"]]


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_decode_tp2_greedy_equals_single_instance(tiny, servers, prefill_tp):
    prefill, decode = servers[f"prefill{prefill_tp}"], servers["decode2"]
    prompts = [_prompt(n, 40 * prefill_tp + n) for n in PROMPT_LENS]
    want = _reference(tiny, prompts)
    before = decode.metrics()
    for n, prompt, ref in zip(PROMPT_LENS, prompts, want):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        params, d = prefill_then_decode(prefill, decode, body, f"tp{prefill_tp}-{n}")
        assert d.status_code == 200, d.text
        assert params["tp_size"] == prefill_tp
        got = _token_ids(d.json())
        if got != ref:
            assert greedy_mismatch(tiny[1], prompt, got) is None, f"prompt length {n}"
    after = decode.metrics()
    # every request's KV was pulled by both decode ranks: exactly the prompt's bytes, no recompute
    transfers = after["kvrelay:kv_transfers_total"] - before["kvrelay:kv_transfers_total"]
    assert transfers == len(PROMPT_LENS)
    assert after["kvrelay:kv_transfer_failures_total"] == 0
    pulled = after["kvrelay:kv_transfer_bytes_total"] - before["kvrelay:kv_transfer_bytes_total"]
    assert pulled == sum(_expected_bytes(n) for n in PROMPT_LENS)
    # read-done notices from both decode ranks were counted: the prefill holds nothing
    m = wait_metric(prefill, "kvrelay:kv_blocks_used", 0)
    assert m["kvrelay:kv_blocks_used"] == 0 and m["kvrelay:kv_requests_held_for_remote"] == 0
    assert m["kvrelay:kv_leases_expired_total"] == 0        # freed by notices, not by the lease
    assert wait_metric(decode, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_streaming_with_n_from_tp2_prefill(tiny, servers):
    prefill, decode = servers["prefill2"], servers["decode2"]
    prompt = _prompt(11, 7)
    want = " " + " ".join(f"w{t}" for t in _reference(tiny, [prompt])[0])
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = httpx.post(f"{prefill.url}/v1/completions", json=first,
                        timeout=60).json()["kv_transfer_params"]
    import json
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{decode.url}/v1/completions", timeout=60,
                      json=dict(body, stream=True, n=2, kv_transfer_params=params)) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert texts[0] == texts[1] == want
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_prefill_tp2_to_decode_tp1_is_refused(tiny, servers, tmp_path):
    prefill = servers["prefill2"]
    decode = start(str(tiny[0]), "kv_consumer", tmp_path / "decode-tp1.log")
    try:
        decode.wait_ready()
        r = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
            "prompt": _prompt(10, 3), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json()["kv_transfer_params"]
        d = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
            "prompt": _prompt(10, 3), "max_tokens": 3, "kv_transfer_params": params})
        assert d.status_code == 502, d.text
        said = "tensor_parallel_size: prefill 2, decode 1"
        assert said in d.json()["error"]["message"]
        deadline = time.monotonic() + 5
        while said not in prefill.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert said in prefill.log()
        assert decode.metrics()["kvrelay:kv_handshake_errors_total"] == 1
        httpx.post(f"{prefill.url}/v1/kv_transfer/free", json={
            "remote_request_id": params["remote_request_id"],
            "remote_capability": params["remote_capability"]})
        assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0
    finally:
        decode.stop()


def test_tcp_transport_prefill_tp2_to_decode_tp2(tiny, tmp_path):
    """The TCP fallback: each rank listens on its own port; same results, nothing held."""
    prefill = start(str(tiny[0]), "kv_producer", tmp_path / "prefill.log", "TCP",
                    flags=["-tp", "2"])
    decode = start(str(tiny[0]), "kv_consumer", tmp_path / "decode.log", "TCP", flags=["-tp", "2"])
    try:
        prefill.wait_ready(timeout=300)
        decode.wait_ready(timeout=300)
        lens = [6, 13]
        prompts = [_prompt(n, 120 + n) for n in lens]
        for n, prompt, ref in zip(lens, prompts, _reference(tiny, prompts)):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0}
            _, d = prefill_then_decode(prefill, decode, body, f"tcp-{n}")
            assert d.status_code == 200, d.text
            got = _token_ids(d.json())
            if got != ref:
                assert greedy_mismatch(tiny[1], prompt, got) is None, f"prompt length {n}"
        m = decode.metrics()
        assert m["kvrelay:kv_transfers_total"] == len(lens)
        assert m["kvrelay:kv_transport_fallback"] == 0
        assert m["kvrelay:kv_transfer_bytes_total"] == sum(_expected_bytes(n) for n in lens)
        assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0
    finally:
        stop_all([prefill, decode])


def test_decode_tp4_with_replicated_kv_heads(tiny, servers, tmp_path):
    """2 KV heads over 4 decode ranks: ranks 0,1 hold head 0 and read it from prefill rank 0,
    ranks 2,3 head 1 from prefill rank 1; the bytes pulled count each replica."""
    prefill = servers["prefill2"]
    decode = start(str(tiny[0]), "kv_consumer", tmp_path / "decode-tp4.log", flags=["-tp", "4"])
    try:
        decode.wait_ready(timeout=300)
        lens = [7, 14]
        prompts = [_prompt(n, 90 + n) for n in lens]
        for n, prompt, ref in zip(lens, prompts, _reference(tiny, prompts)):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0}
            _, d = prefill_then_decode(prefill, decode, body, f"tp4-{n}")
            assert d.status_code == 200, d.text
            got = _token_ids(d.json())
            if got != ref:
                assert greedy_mismatch(tiny[1], prompt, got) is None, f"prompt length {n}"
        m = decode.metrics()
        assert m["kvrelay:kv_transfers_total"] == len(lens)
        assert m["kvrelay:kv_transfer_bytes_total"] == 2 * sum(_expected_bytes(n) for n in lens)
        m = wait_metric(prefill, "kvrelay:kv_requests_held_for_remote", 0)    # 4 notices each
        assert m["kvrelay:kv_requests_held_for_remote"] == 0 and m["kvrelay:kv_blocks_used"] == 0
    finally:
        decode.stop()
