"""`kvrelay serve --speculative-config`: a real server answers as the engine without
speculation does and its `vllm:spec_decode_*` counters move, with n-gram drafts and with a
draft model; a draft path without a checkpoint is refused in one line before torch loads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from tests.engine.test_spec_decode import NGRAM, PROMPTS
from tests.processes import Server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_server_answers_as_without_speculation_and_counts_drafts(tiny, tmp_path, method):
    spec = NGRAM if method == "ngram" else {"model": str(tiny[0]), "num_speculative_tokens": 3}
    flags = ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
             "--served-model-name", "tiny", "--speculative-config", json.dumps(spec)]
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True))]
    llm.shutdown()
    server = Server(str(tiny[0]), flags, tmp_path / "serve.log")
    try:
        server.wait_ready()
        got = []
        for prompt in PROMPTS[:2]:
            r = httpx.post(f"{server.url}/v1/completions", json=body | {"prompt": prompt},
                           timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        m = server.metrics()
        drafts = m["vllm:spec_decode_num_drafts_total"]
        accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < accepted <= m["vllm:spec_decode_num_draft_tokens_total"]
        if method == "draft_model":          # the target as its own draft: all accepted
            assert accepted == m["vllm:spec_decode_num_draft_tokens_total"]
        assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] > 0   # position 0
        assert m["kvrelay:kv_blocks_used"] == 0
    finally:
        server.stop()


def test_a_draft_path_without_a_checkpoint_is_refused_in_one_line_before_torch():
    config = json.dumps({"model": "/ckpt/draft", "num_speculative_tokens": 4})
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvrelay.cli", "serve",
                          "--speculative-config", config], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=False)
    errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert out.returncode == 1
    assert errors == ["kvrelay serve: error: --speculative-config: draft model '/ckpt/draft': "
                      "not a checkpoint directory (no config.json there)"], out.stderr[-2000:]
    assert "| torch" not in out.stderr
