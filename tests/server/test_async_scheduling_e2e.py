"""`kvrelay serve --async-scheduling`: a real server answers as the synchronous engine
does — concurrent greedy, stopped, streamed and seeded requests — and a client that
disconnects mid-stream leaves no request or KV block behind."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from tests.processes import Server

FLAGS = ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
         "--async-scheduling", "--served-model-name", "tiny"]
PROMPTS = [[5, 17, 29, 40, 41, 42, 77], [100, 101, 7], list(range(20, 50)), [9, 8]]
# (request body fields, the same as SamplingParams)
CASES = [
    ({"max_tokens": 12, "temperature": 0, "ignore_eos": True},
     SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
    ({"max_tokens": 12, "temperature": 0, "stop": ["w88"]},
     SamplingParams(max_tokens=12, temperature=0, stop=["w88"])),
    ({"max_tokens": 1, "temperature": 0},
     SamplingParams(max_tokens=1, temperature=0)),
    ({"max_tokens": 9, "temperature": 1.0, "seed": 4, "n": 2},
     SamplingParams(max_tokens=9, temperature=1.0, seed=4, n=2)),
]


@pytest.fixture(scope="module")
def async_server(tiny, tmp_path_factory):
    s = Server(str(tiny[0]), FLAGS, tmp_path_factory.mktemp("async") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _complete(url: str, prompt: list[int], body: dict, stream: bool = False) -> list[str]:
    payload = {"model": "tiny", "prompt": prompt, **body}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    import json
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload | {"stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return [texts[i] for i in sorted(texts)]


def test_concurrent_requests_answer_as_the_synchronous_engine(tiny, async_server):
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    jobs = [(p, body, params, stream) for p in PROMPTS for body, params in CASES
            for stream in (False, True)]
    want = [[c.text for c in out.outputs] for out in
            llm.generate([p for p, *_ in jobs], [params for _, _, params, _ in jobs])]
    llm.shutdown()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: _complete(async_server.url, j[0], j[1], j[3]), jobs))
    assert got == want


def test_a_client_gone_mid_stream_frees_its_blocks(async_server):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 80, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{async_server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = async_server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["kvrelay:kv_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert m["vllm:num_requests_running"] == 0 and m["kvrelay:kv_blocks_used"] == 0
    assert m["vllm:generation_tokens_total"] > 0
    assert _complete(async_server.url, [1, 2, 3], CASES[0][0])     # still serving
