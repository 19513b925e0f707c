"""The tutorial's DI deployment on one machine: prefill servers + a decode server behind
`kvrelay proxy`, driven by the openai client; 2P1D round-robins the prefill servers."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from kvrelay import LLM, SamplingParams
from tests.e2e.disagg import start, wait_metric
from tests.factories import greedy_mismatch
from tests.processes import KvrelayProcess, free_port

PROMPTS = [[(5 * i + j) % 150 + 4 for i in range(n)] for j, n in enumerate([3, 9, 14, 27])]


@pytest.fixture(scope="module")
def deployment(tiny, tmp_path_factory):
    """2 prefill servers (UCX_TLS=tcp: a real network path) + 1 decode + the proxy."""
    logs = tmp_path_factory.mktemp("2p1d")
    env = {"UCX_TLS": "tcp"}
    prefills = [start(str(tiny[0]), "kv_producer", logs / f"prefill{i}.log", env=env)
                for i in range(2)]
    decode = start(str(tiny[0]), "kv_consumer", logs / "decode.log", env=env)
    port = free_port()
    proxy = KvrelayProcess(["proxy", "--port", str(port), "--prefiller-host", "127.0.0.1",
                            "--prefiller-port",
                            *[str(p.port) for p in prefills], "--decoder-host", "127.0.0.1",
                            "--decoder-port", str(decode.port)], logs / "proxy.log")
    try:
        for s in prefills + [decode]:
            s.wait_ready()
        proxy.wait_for_line("Application startup complete")
        url = f"http://127.0.0.1:{port}"
        _wait_all_healthy(url, len(prefills) + 1)
        yield url, prefills, decode
    finally:
        proxy.stop()
        for s in prefills + [decode]:
            s.stop()


def _wait_all_healthy(url: str, backends: int, timeout_s: float = 60.0) -> None:
    """Until the proxy's own background probes have seen every backend answer: it starts
    probing while the servers still load, and a backend marked down before it was ready
    only gets traffic again after its next probe round (every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in httpx.get(f"{url}/metrics").text.splitlines()
                 if ln.startswith("kvrelay_proxy:backend_healthy{")]
        if len(lines) == backends and all(ln.endswith(" 1.0") for ln in lines):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"backends not all healthy after {timeout_s} s: {lines}")
        time.sleep(0.2)


def test_tutorial_validation_through_the_proxy(deployment):
    url, _, _ = deployment
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"prompt": "w5 w17 w29", "max_tokens": 16, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["text"]
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 16


def test_greedy_through_the_proxy_equals_single_instance(tiny, deployment):
    url, prefills, decode = deployment
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    for prompt, w in zip(PROMPTS, want):
        got = client.completions.create(model=str(tiny[0]), prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        if got.choices[0].text != w.outputs[0].text:
            ids = [int(t.removeprefix("w")) for t in got.choices[0].text.split()]
            assert greedy_mismatch(tiny[1], prompt, ids) is None
        streamed = client.completions.create(model=str(tiny[0]), prompt=prompt, max_tokens=8,
                                             temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == got.choices[0].text
    # both prefill servers took turns, the decode pulled KV each time, nothing is held
    served = [p.metrics()["vllm:prompt_tokens_total"] for p in prefills]
    assert all(n > 0 for n in served)
    m = decode.metrics()
    assert m["kvrelay:kv_transfers_total"] >= len(PROMPTS)
    assert m["kvrelay:kv_transfer_failures_total"] == 0
    for p in prefills:
        assert wait_metric(p, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_chat_through_the_proxy(tiny, deployment):
    url, _, _ = deployment
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=str(tiny[0]),
                                         messages=[{"role": "user", "content": "w10 w11"}],
                                         max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content and out.usage.completion_tokens == 5


def test_a_request_a_prefill_refuses_is_not_sent_to_the_other(deployment):
    """Real servers: the prefill's 400 comes back as is, and the other prefill never sees the
    request (the proxy re-sends nothing a server answered)."""
    url, prefills, _ = deployment
    refused = '"POST /v1/completions HTTP/1.1" 400'

    def refusals() -> int:
        return sum(p.log().count(refused) for p in prefills)

    before = refusals()
    for i in range(2):                          # round-robin: one lands on each prefill server
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       headers={"X-Request-Id": f"bad-temp-{i}"},
                       json={"prompt": "w5 w17", "max_tokens": 4, "temperature": -1})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + 5
    while refusals() < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    assert refusals() == before + 2             # once each, not once per server per request
    assert all(p.log().count(refused) >= 1 for p in prefills)
