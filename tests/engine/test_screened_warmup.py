"""The screened greedy LM head (layers/screened.py) is made and checked in the engine's
warm-up (`ModelRunner.warm_greedy_head`) for every decode step's key — 1..max_num_seqs rows,
at the runner's thread counts — so the first greedy requests run no check of their own."""
from __future__ import annotations

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.engine.sampler import argmax_rows
from tests.factories import greedy_mismatch

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _screen_or_skip(llm):
    plan = llm.engine.model.plan
    if not plan.screened_head:
        pytest.skip(f"this process's plan does not screen the head: {plan.describe()}")
    return llm.engine.model.lm_head.screen


def test_the_first_greedy_requests_run_no_check(tiny, make_llm):
    llm = make_llm(max_num_seqs=3)
    screen = _screen_or_skip(llm)
    assert screen is not None and screen.copy is not None        # made in warm-up
    warmed = screen.checks
    assert warmed == 3 and len(screen.verdicts) == 3              # rows 1, 2, 3
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 9, 14)]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        problem = greedy_mismatch(tiny[1], prompt, list(out.outputs[0].token_ids))
        assert problem is None, problem
    assert screen.checks == warmed                                # nothing checked lazily
    assert screen.stats.answered > 0                              # and the screen was used


def test_a_key_not_warmed_is_still_checked_on_first_use(tiny, make_llm):
    llm = make_llm(max_num_seqs=1)
    screen = _screen_or_skip(llm)
    assert screen.checks == 1
    head = llm.engine.model.lm_head
    x = torch.randn(2, head.weight.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ids = head.greedy(x)                                       # two rows: a new key
    assert screen.checks == 2
    assert ids is not None and torch.equal(ids, argmax_rows(head(x).float()))
