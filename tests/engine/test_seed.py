"""--seed: unseeded sampling is reproducible for a given engine seed (as in vLLM)."""
from __future__ import annotations

from kvrelay import SamplingParams

PROMPT = [5, 9, 14, 20]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


def sample(llm) -> list[list[int]]:
    outs = llm.generate([PROMPT, PROMPT], SAMPLED)
    return [o.outputs[0].token_ids for o in outs]


def test_same_seed_same_tokens_other_seed_other_tokens(make_llm):
    first = sample(make_llm(seed=7))
    again = sample(make_llm(seed=7))          # a second engine: this process's RNG moved on
    other = sample(make_llm(seed=8))
    assert first == again
    assert first[0] != first[1]               # the two requests still draw different noise
    assert other != first
