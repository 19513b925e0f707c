"""Greedy decoding through the engine with the screened LM head (layers/screened.py) gives the
exact head's tokens: the benchmark's tiny bf16 gpt-oss (hidden 32, the o200k vocabulary of
201,088 rows: the LM head is most of a step), 520 tokens per sequence at max_num_seqs 1 and
8, screened against KVRELAY_SCREENED_HEAD=off's path in the same engine."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvrelay.model import kernels
from tests.factories import add_word_tokenizer, save_checkpoint

pytestmark = pytest.mark.skipif(not kernels.status().available,
                                reason="the native kernels cannot be built here")

# benchmarks/peers.py TINY: the serving benchmarks' tiny model
TINY = dict(vocab_size=201088, hidden_size=32, intermediate_size=32, head_dim=64,
            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
            max_position_embeddings=4096, eos_token_id=200002, pad_token_id=199999)
TOKENS = 520


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """The tiny model as benchmarks/peers.py builds it (bf16, its initialisation), with a
    word tokenizer over the vocabulary."""
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router.weight" in name:
                p.normal_(0.0, 4 / TINY["hidden_size"] ** 0.5)
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
    path = save_checkpoint(model.to(torch.bfloat16), tmp_path_factory.mktemp("tiny-bf16"))
    add_word_tokenizer(path, TINY["vocab_size"])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002]}))
    return path


@pytest.mark.parametrize("seqs", [1, 8])
def test_screened_greedy_decoding_gives_the_exact_heads_tokens(tiny_bf16, seqs):
    from kvrelay import LLM, SamplingParams
    llm = LLM(str(tiny_bf16), max_num_seqs=seqs, max_model_len=1024)
    try:
        model = llm.engine.model
        plan = model.plan
        if not plan.screened_head:
            pytest.skip(f"the plan does not screen the head: {plan.describe()}")
        prompts = [" ".join(f"w{(97 * i + 13 * j) % 5000 + 10}" for j in range(5 + 3 * i))
                   for i in range(seqs)]
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        runs = {}
        for screened in (True, False):
            model.use_plan(dataclasses.replace(plan, screened_head=screened))
            outs = llm.generate(prompts, params)
            runs[screened] = [list(o.outputs[0].token_ids) for o in outs]
        assert runs[True] == runs[False]
        assert all(len(t) == TOKENS for t in runs[True])
        assert len({tok for t in runs[True] for tok in t}) > 50       # not one token repeated
        stats = model.lm_head.screen.stats
        assert stats.answered >= TOKENS - 10 and stats.fallbacks == 0
    finally:
        llm.shutdown()
