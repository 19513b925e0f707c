"""A live `kvrelay serve` on the tiny checkpoint, driven by the official openai client."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from kvrelay import LLM, SamplingParams

PROMPT = [5, 17, 29, 40, 41, 42, 77, 90, 91, 12, 13]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny):
    return LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "openai/gpt-oss-120b"]


def test_greedy_completion_equals_offline_engine(client, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True))[0].outputs[0]
    got = client.completions.create(model="openai/gpt-oss-120b", prompt=PROMPT, max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens,
            got.usage.total_tokens) == (11, 12, 23)


def test_streaming_completion_equals_non_streaming(client):
    kwargs = dict(model="tiny", prompt="w5 w17 w29", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_echo_stop_and_logprobs(client):
    out = client.completions.create(model="tiny", prompt="w5 w17 w29", max_tokens=6, n=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 1 and out.usage.completion_tokens == 18
    echo = client.completions.create(model="tiny", prompt="w5 w17 w29", max_tokens=3, temperature=0,
                                     echo=True, extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith("w5 w17 w29")
    base = client.completions.create(model="tiny", prompt="w5 w17 w29", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop_word = base.split()[2]
    cut = client.completions.create(model="tiny", prompt="w5 w17 w29", max_tokens=8, temperature=0,
                                    stop=[" " + stop_word],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(" " + stop_word)]
    lp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                   logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    # greedy = top-1
    assert all(max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_completion_and_stream(client):
    messages = [{"role": "user", "content": "w10 w11"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0,
                                          extra_body={"ignore_eos": True}, logprobs=True,
                                          top_logprobs=2)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.usage.prompt_tokens == 5                # w1 w10 w11 w2 w4
    assert len(full.choices[0].logprobs.content) == 8
    # logprobs alone (no top_logprobs): the chosen tokens' logprobs, no alternatives (OpenAI)
    bare = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True},
                                          logprobs=True).choices[0].logprobs.content
    assert [(t.token, t.top_logprobs) for t in bare] == [
        (t.token, []) for t in full.choices[0].logprobs.content]
    assert [t.logprob for t in bare] == pytest.approx(
        [t.logprob for t in full.choices[0].logprobs.content], abs=1e-4)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                 temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body,status,fragment", [
    ('{"prompt": "w1", "max_tokens": ', 400, "malformed JSON"),
    ({"prompt": "w1", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "w1", "model": "nope"}, 404, "The model `nope` does not exist"),
    ({"prompt": list(range(1, 100))}, 400, "maximum context length is 96"),
    ({"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "w1", "max_tokens": 200}, 400,
     "you requested 201 tokens (1 in the prompt, 200 in the completion)"),
    ({"prompt": "w1", "temperature": -1}, 400, "temperature"),
    ({"prompt": "w1", "logprobs": 6}, 400, "exceeds the server's --max-logprobs 5"),
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 999]}, 400, "prompt token ids must be in [0, 160)"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_input_is_a_4xx_with_an_openai_error(server, body, status, fragment):
    chat = isinstance(body, dict) and "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}{path}", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert fragment in _error(r)["message"]


def test_body_over_the_size_limit(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (33 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "request body over" in _error(r)["message"]


def test_bad_requests_leave_others_untouched(server, client):
    results = {}

    def good():
        results["good"] = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                                    temperature=0, extra_body={"ignore_eos": True})

    t = threading.Thread(target=good)
    t.start()
    for _ in range(10):
        assert httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "w1", "max_tokens": 0}).status_code == 400
    t.join(60)
    assert results["good"].usage.completion_tokens == 20


def test_request_id_is_echoed(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "w1", "max_tokens": 2},
                   headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "cmpl-abc-123"


def test_metrics_parse_and_use_vllm_names(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "kvrelay:kv_blocks_free"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] >= 3
