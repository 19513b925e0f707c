"""`kvrelay serve` with no MODEL: the embedded model answers the tutorial's validation
requests, and its greedy chat answers equal transformers' on the converted checkpoint."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.processes import Server


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kvrelay-cache")
    s = Server(None, ["--dtype", "float32", "--max-model-len", "1024", "--served-model-name",
                      "openai/gpt-oss-120b", "kvrelay/smollm2-135m-gpt-oss"],
               cache / "serve.log", env={"KVRELAY_CACHE_DIR": str(cache)})
    try:
        s.wait_ready(timeout=300)
        from kvrelay.model.embedded import embedded_model_dir
        yield s, embedded_model_dir(cache)
    finally:
        s.stop()


def test_tutorial_validation_requests(embedded):
    server, _ = embedded
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": "openai/gpt-oss-120b", "prompt": "The capital of France is ", "max_tokens": 16})
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"].strip()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0


def test_paris_completion(embedded):
    server, _ = embedded
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(model="kvrelay/smollm2-135m-gpt-oss",
                                    prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text


def test_greedy_chat_equals_transformers(embedded):
    from transformers import AutoTokenizer, GptOssForCausalLM
    server, model_dir = embedded
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="kvrelay/smollm2-135m-gpt-oss", messages=messages,
                                         max_tokens=20, temperature=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    assert out.usage.prompt_tokens == ids.shape[1]
    ref = GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                            attn_implementation="eager")
    with torch.no_grad():
        gen = ref.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
    want = tok.decode(gen, skip_special_tokens=True)
    assert out.choices[0].message.content == want
    assert "Paris" in want
