"""--data-parallel-size 2: two engine replicas behind one API server."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from kvrelay import LLM, SamplingParams
from tests.processes import Server, descendants


def test_two_replicas_serve_and_match_one_engine(tiny, tmp_path):
    prompts = [[5, 17, 29, 40], [100, 101, 7], list(range(20, 45)), [9, 9, 9, 9, 9, 1]]
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0,
                                                                                 max_tokens=8,
                                                                                ignore_eos=True))]
    s = Server(str(tiny[0]),
               ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4", "-dp", "2"],
               tmp_path / "serve.log", env={"NEURON_VISIBLE_DEVICES": "0-1"})
    try:
        s.wait_ready()
        assert s.log().count("warm-up done") == 2
        assert "pinned to CPU cores [0]" in s.log() and "pinned to CPU cores [1]" in s.log()
        assert len(descendants(s.proc.pid)) >= 2

        def ask(p):
            r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
                "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1})
            return r.json()["choices"][0]["logprobs"]["tokens"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
        tok = llm.get_tokenizer()
        assert got == [[tok.decode([t], skip_special_tokens=False) for t in w] for w in want]
        assert s.metrics()["kvrelay:kv_blocks_used"] == 0
    finally:
        s.stop()
