"""The tutorial's DI deployment on one machine: 2 prefill servers + a decode server (tiny
model) behind `kvrelay proxy`, driven by the openai client; 2P1D round-robins the prefill
servers.

The router on the same servers, behind two more proxies, `--disagg-policy always` and
`auto`, both `--routing cache_aware` (the default):

- a repeated conversation reaches the prefill that cached it: that server's prefix-cache hit
  counter rises, the other's does not;
- under `auto` a short prompt never reaches a prefill (their prompt-token counters stay put);
- a killed prefill's table entries are dropped and its conversation moves to the other one
  (the module's last test: it ends one of the servers).

One set of servers for the module: three starts are most of its time."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from kvrelay import LLM, SamplingParams
from tests.e2e.disagg import start, wait_metric
from tests.factories import greedy_mismatch
from tests.processes import KvrelayProcess, Server, free_port, stop_all

PROMPTS = [[(5 * i + j) % 150 + 4 for i in range(n)] for j, n in enumerate([3, 9, 14, 27])]
HITS, PROMPT_TOKENS = "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"
CONVERSATION = [(7 * i) % 150 + 4 for i in range(40)]      # 10 blocks of 4 tokens


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """2 prefill servers (UCX_TLS=tcp: a real network path) + 1 decode."""
    logs = tmp_path_factory.mktemp("2p1d")
    env = {"UCX_TLS": "tcp"}
    prefills = [start(str(tiny[0]), "kv_producer", logs / f"prefill{i}.log", env=env)
                for i in range(2)]
    decode = start(str(tiny[0]), "kv_consumer", logs / "decode.log", env=env)
    try:
        for s in prefills + [decode]:
            s.wait_ready()
        yield prefills, decode
    finally:
        stop_all([*prefills, decode])


@pytest.fixture(scope="module")
def deployment(servers, tmp_path_factory):
    """The servers behind the tutorial's proxy (round-robin prefills)."""
    prefills, decode = servers
    port = free_port()
    proxy = KvrelayProcess(["proxy", "--port", str(port), "--prefiller-host", "127.0.0.1",
                            "--prefiller-port",
                            *[str(p.port) for p in prefills], "--decoder-host", "127.0.0.1",
                            "--decoder-port", str(decode.port)],
                           tmp_path_factory.mktemp("2p1d-proxy") / "proxy.log")
    try:
        proxy.wait_for_line("Application startup complete")
        url = f"http://127.0.0.1:{port}"
        _wait_all_healthy(url, len(prefills) + 1)
        yield url, prefills, decode
    finally:
        proxy.stop()


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


# -- routing ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routed(servers, tmp_path_factory):
    """The servers behind two more proxies: policies `always` and `auto`."""
    prefills, decode = servers
    logs = tmp_path_factory.mktemp("routed")
    proxies: dict[str, tuple[str, KvrelayProcess]] = {}
    try:
        for policy in ("always", "auto"):
            port = free_port()
            args = ["proxy", "--port", str(port), "--log-level", "debug", "--health-interval",
                    "0.3",
                    "--routing-block-size", "4", "--disagg-policy", policy, "--direct-max-tokens",
                    "16", "--prefiller-port", *[str(p.port) for p in prefills],
                    "--decoder-port", str(decode.port)]
            proxies[policy] = (f"http://127.0.0.1:{port}",
                               KvrelayProcess(args, logs / f"proxy-{policy}.log"))
        for _, proc in proxies.values():
            proc.wait_for_line("Application startup complete")
        yield proxies, prefills, decode
    finally:
        stop_all([proc for _, proc in proxies.values()])


def complete(url: str, prompt: list[int], request_id: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Request-Id": request_id},
                   json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def served(prefills: list[Server], metric: str) -> list[float]:
    return [p.metrics().get(metric, 0.0) for p in prefills]


def test_a_repeated_conversation_hits_the_prefill_that_cached_it(routed):
    proxies, prefills, _ = routed
    url, proxy = proxies["always"]
    before_tokens = served(prefills, PROMPT_TOKENS)
    complete(url, CONVERSATION, "conv-1")
    took = [a - b for a, b in zip(served(prefills, PROMPT_TOKENS), before_tokens)]
    holder = 0 if took[0] else 1
    assert took[holder] == len(CONVERSATION) and took[1 - holder] == 0
    hits = served(prefills, HITS)
    for turn in range(3):                       # the conversation grows; it stays put
        complete(url, CONVERSATION + [5 + turn] * 4 * (turn + 1), f"conv-{turn + 2}")
    after = served(prefills, HITS)
    assert after[holder] - hits[holder] >= 3 * 36   # the 40-token prefix (9+ blocks) each time
    assert after[1 - holder] == hits[1 - holder]
    assert "(cache_hit, 10/" in proxy.log()


def test_a_short_prompt_under_auto_never_touches_a_prefill(routed):
    proxies, prefills, decode = routed
    url, proxy = proxies["auto"]
    before, decoded = served(prefills, PROMPT_TOKENS), decode.metrics()[PROMPT_TOKENS]
    out = complete(url, [11, 12, 13, 14, 15], "short")
    assert out["usage"]["completion_tokens"] == 4
    assert served(prefills, PROMPT_TOKENS) == before
    assert decode.metrics()[PROMPT_TOKENS] == decoded + 5     # the decode prefilled it itself
    assert "request short: route: direct to decode (5 uncached tokens <= 16)" in proxy.log()


def test_a_killed_prefill_is_forgotten_and_its_conversation_reroutes(routed):
    proxies, prefills, _ = routed
    url, proxy = proxies["always"]
    talk = [(11 * i) % 150 + 4 for i in range(32)]
    before = served(prefills, PROMPT_TOKENS)
    complete(url, talk, "kill-1")
    holder = 0 if served(prefills, PROMPT_TOKENS)[0] > before[0] else 1
    survivor = prefills[1 - holder]
    prefills[holder].stop()
    name = f"127.0.0.1:{prefills[holder].port}"
    deadline = time.monotonic() + 15
    while f"prefill server {name}: forgot the" not in proxy.log():
        assert time.monotonic() < deadline, proxy.log()[-2000:]
        time.sleep(0.1)
    tokens = survivor.metrics()[PROMPT_TOKENS]
    complete(url, talk + [9, 9, 9, 9], "kill-2")
    assert survivor.metrics()[PROMPT_TOKENS] == tokens + len(talk) + 4
