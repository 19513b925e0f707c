"""Speculative decoding keeps the sampled law: the tokens drawn while verifying drafts are
distributed as without drafts (kvrelay/engine/spec_verify.py). Chi-square tests on fixed
seeds (deterministic, so never flaky), against the exact processed distribution and
against the engine with speculation off."""
from __future__ import annotations

from collections import Counter

import torch

from kvrelay import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.spec_verify import verify
from tests.engine.test_spec_decode import NGRAM, PROMPTS

# three rows of logits over 6 tokens: row j is the target's law after j accepted drafts
ROWS = torch.tensor([[2.0, 1.5, 0.3, 0.0, -1.0, -3.0],
                     [0.1, 0.4, 1.2, 1.0, -0.5, 0.0],
                     [1.0, 1.0, 1.0, 0.2, 0.2, 3.0]])
DRAFT = [1, 2]                       # likely but not certain at rows 0 and 1
TEMPERATURE, TOP_K = 0.8, 4


def processed(row: torch.Tensor) -> torch.Tensor:
    """The law the sampler draws from: /temperature, the top-k kept, softmax."""
    x = row / TEMPERATURE
    kth = x.topk(TOP_K).values[-1]
    return torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)


def p_value(counts: list[float], expected: list[float]) -> float:
    """Pearson's chi-square test over the categories with expected counts (df = k - 1)."""
    cells = [(c, e) for c, e in zip(counts, expected) if e > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_verified_tokens_follow_the_target_law_at_every_position():
    torch.manual_seed(0)
    n = 20000
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
    requests = [Request(f"r{i}", [1], params) for i in range(n)]
    logits = ROWS.repeat(n, 1)                                           # [3n, 6]
    out = verify(Sampler(), logits, requests, [3 * i for i in range(n)], [DRAFT] * n)
    assert not out.errors
    for j in range(3):             # the token at j, among outputs whose drafts before j held
        reached = [t for t in out.tokens if len(t) > j and t[:j] == DRAFT[:j]]
        law = processed(ROWS[j])
        counts = Counter(t[j] for t in reached)
        assert p_value([counts[v] for v in range(6)], [len(reached) * float(p) for p in law]) \
            > 1e-3, (j, counts, law)
        if j < len(DRAFT):          # accepted with probability p(draft), else ended there
            accepted = sum(1 for t in reached if t[j] == DRAFT[j]) / len(reached)
            assert abs(accepted - float(law[DRAFT[j]])) < 0.02
    assert all(len(t) == 1 or t[:len(t) - 1] == DRAFT[:len(t) - 1] for t in out.tokens)
    assert Counter(len(t) for t in out.tokens).keys() == {1, 2, 3}


def test_seeded_verification_draws_as_plain_decoding_does():
    """A seeded request's token at each output position comes from the same noise with or
    without drafts: verifying [d1, d2] gives what three plain decodes would have given."""
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=s) for s in range(200)]
    spec = [Request(f"s{i}", [1], p) for i, p in enumerate(params)]
    out = verify(Sampler(), ROWS.repeat(len(spec), 1), spec, [3 * i for i in range(len(spec))],
                 [DRAFT] * len(spec))
    sampler = Sampler()
    for p, tokens in zip(params, out.tokens):
        plain = Request("p", [1], p)
        want = [sampler(ROWS[j:j + 1], [plain]).token_ids[0] for j in range(len(tokens))]
        assert tokens == want


def test_engine_samples_the_same_law_with_speculation_on(make_llm):
    """Unseeded sampling on a prompt whose greedy continuation repeats one token (drafts
    are accepted often), at temperature 0.05 (this random model's logits lie within ~0.1 of
    each other: 0.05 spreads the law over a few tokens): the law of each output token from
    the third on is the engine's without speculation (two-sample chi-square)."""
    params = SamplingParams(temperature=0.05, max_tokens=6, ignore_eos=True)
    prompt, n = PROMPTS[0], 400
    off = make_llm(seed=1).generate([prompt] * n, params)
    llm = make_llm(seed=2, speculative_config=NGRAM)
    on = llm.generate([prompt] * n, params)
    assert llm.engine.spec_stats.num_accepted_tokens > n // 2
    for j in range(2, 6):
        a = Counter(o.outputs[0].token_ids[j] for o in on)
        b = Counter(o.outputs[0].token_ids[j] for o in off)
        assert two_sample_p_value(a, b) > 1e-3, (j, a, b)


def two_sample_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples of equal size share one law, over the tokens seen
    at least 20 times in both together (the others pooled into one cell)."""
    frequent = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 20]
    rest = [t for t in a.keys() | b.keys() if t not in frequent]
    rows = [(a[t], b[t]) for t in frequent] + [(sum(a[t] for t in rest), sum(b[t] for t in rest))]
    rows = [r for r in rows if sum(r)]
    assert len(rows) >= 2                   # a law worth comparing, not one certain token
    # a 2 x k table of equal sample sizes: each cell expects half its column
    stat = sum(2 * (x - (x + y) / 2) ** 2 / ((x + y) / 2) for x, y in rows)
    return float(torch.special.gammaincc(torch.tensor((len(rows) - 1) / 2.0),
                                         torch.tensor(stat / 2.0)))
