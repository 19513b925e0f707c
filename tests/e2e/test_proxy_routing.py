"""The router with real servers: 2 prefills + 1 decode (tiny model) behind two proxies,
`--disagg-policy always` and `auto`, both `--routing cache_aware` (the default).

- a repeated conversation reaches the prefill that cached it: that server's prefix-cache hit
  counter rises, the other's does not;
- under `auto` a short prompt never reaches a prefill (their prompt-token counters stay put);
- a killed prefill's table entries are dropped and its conversation moves to the other one.
"""
from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.disagg import start
from tests.processes import KvrelayProcess, free_port

HITS, PROMPT_TOKENS = "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"
CONVERSATION = [(7 * i) % 150 + 4 for i in range(40)]      # 10 blocks of 4 tokens


@pytest.fixture(scope="module")
def routed(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("routed")
    env = {"UCX_TLS": "tcp"}
    prefills = [start(str(tiny[0]), "kv_producer", logs / f"prefill{i}.log", env=env)
                for i in range(2)]
    decode = start(str(tiny[0]), "kv_consumer", logs / "decode.log", env=env)
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
        for s in prefills + [decode]:
            s.wait_ready()
        for _, proc in proxies.values():
            proc.wait_for_line("Application startup complete")
        yield proxies, prefills, decode
    finally:
        for _, proc in proxies.values():
            proc.stop()
        for s in prefills + [decode]:
            s.stop()


def complete(url: str, prompt: list[int], request_id: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Request-Id": request_id},
                   json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def served(prefills, metric: str) -> list[float]:
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
