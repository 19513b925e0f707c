"""`kvrelay serve` with no MODEL: the embedded model answers the tutorial's validation
requests, and its greedy chat answers equal transformers' on the converted checkpoint."""
from __future__ import annotations

import json
import re
from pathlib import Path

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


def test_the_readme_completion_answers_paris(embedded):
    """The README's first completion request, as written there, answers what it says."""
    server, _ = embedded
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    body = json.loads(re.search(r"""/v1/completions .*\n\s*-d '(\{.*\})'""", readme).group(1))
    assert body["temperature"] == 0
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith(" Paris.")
    assert f"Its `choices[0].text` is `{json.dumps(text)}`" in readme


def test_models_root_is_the_loaded_checkpoint(embedded):
    server, model_dir = embedded
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["openai/gpt-oss-120b", "kvrelay/smollm2-135m-gpt-oss"]
    assert {m["root"] for m in data} == {str(Path(model_dir).absolute())}


def test_validate_passes_and_knows_the_answers(embedded):
    """`kvrelay validate` on the embedded model served as openai/gpt-oss-120b: it recognises
    the model by /v1/models' root and requires "Paris" from both greedy answers."""
    from kvrelay.deploy.validate import ValidateOptions, run_checks
    server, _ = embedded
    results = run_checks(ValidateOptions(base_url=server.url, num_requests=2, timeout=120))
    assert [r.line() for r in results if not r.ok] == []
    details = {r.name: r.detail for r in results}
    assert "openai/gpt-oss-120b" in details["models"]
    assert "contains 'Paris'" in details["completion"] and "contains 'Paris'" in details["chat"]


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
