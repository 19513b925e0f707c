"""Structured outputs in 1P1D behind `kvrelay proxy`: the prefill samples its one token
under the grammar, the decode (which samples its own first token) masks from its first
token on, and every output validates."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.disagg import prefill_then_decode, start, wait_metric
from tests.processes import KvrelayProcess, free_port, stop_all
from tests.structured.schemas import PERSON, REGEX, WEATHER, valid_json, valid_regex


@pytest.fixture(scope="module")
def pair(bytes_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured-1p1d")
    prefill = start(str(bytes_ckpt), "kv_producer", logs / "prefill.log", "TCP")
    decode = start(str(bytes_ckpt), "kv_consumer", logs / "decode.log", "TCP")
    port = free_port()
    proxy = KvrelayProcess(["proxy", "--port", str(port), "--prefiller-host", "127.0.0.1",
                            "--prefiller-port", str(prefill.port), "--decoder-host", "127.0.0.1",
                            "--decoder-port", str(decode.port)], logs / "proxy.log")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy.wait_for_line("Application startup complete")
        yield f"http://127.0.0.1:{port}", prefill, decode
    finally:
        stop_all([proxy, prefill, decode])


def test_both_legs_apply_the_grammar(pair):
    _, prefill, decode = pair
    body = {"prompt": "Describe a person:", "max_tokens": 80, "temperature": 1.0, "seed": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": PERSON}}}
    first = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    r = httpx.post(f"{prefill.url}/v1/completions", json=first, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text
    held = r.json()["kv_transfer_params"]                             # no decode reads these
    httpx.post(f"{prefill.url}/v1/kv_transfer/free", timeout=10, json={
        "remote_request_id": held["remote_request_id"],
        "remote_capability": held["remote_capability"]})
    _, d = prefill_then_decode(prefill, decode, body, "structured-legs")
    assert d.status_code == 200, d.text
    valid_json(d.json()["choices"][0]["text"], PERSON)
    assert decode.metrics()["kvrelay:kv_transfers_total"] >= 1


def test_outputs_valid_through_the_proxy(bytes_ckpt, pair):
    url, prefill, _ = pair
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for seed in range(4):
        out = client.chat.completions.create(
            model=str(bytes_ckpt), seed=seed, temperature=1.0, max_tokens=60,
            messages=[{"role": "user", "content": "Weather?"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "w", "schema": WEATHER}})
        valid_json(out.choices[0].message.content, WEATHER)
        text = client.completions.create(model=str(bytes_ckpt), prompt="Code:", seed=seed,
                                         temperature=1.0,
                                         max_tokens=20, extra_body={"guided_regex": REGEX})
        valid_regex(text.choices[0].text)
    m = wait_metric(prefill, "kvrelay:kv_blocks_used", 0)
    assert m["kvrelay:kv_blocks_used"] == 0
