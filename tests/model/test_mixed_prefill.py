"""Steps that mix prefill chunks continuing a cached prefix with prompts from position 0:
the continued chunks (first, as the scheduler orders them) take the gather path, the
fresh ones that close the step the fresh path (native kernel or SDPA pieces); the layer's
output equals the all-reference path's."""
from __future__ import annotations

import pytest
import torch

# fresh_path: the autouse fixture running every test on both fresh paths (kernel, SDPA pieces)
from tests.model.test_fresh_prefill import B, _compare, fresh_path  # noqa: F401


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("q_lens,seq_lens,fresh", [
    ([12, 9, 2 * B + 3], [30, 9, 2 * B + 3], [9, 2 * B + 3]),     # one continued, two fresh
    ([1, 1, 7, 3, 20, B], [17, 4, 7, 40, 20, B], [20, B]),         # decodes, fresh, continued
    ([5, B + 1], [B + 5, B + 1], [B + 1]),                          # continued mid-block
])
def test_fresh_chunks_after_continued_ones_match_reference(window, q_lens, seq_lens, fresh):
    meta = _compare(6, 2, 16, window, q_lens, seq_lens=seq_lens)
    plan = meta.fresh_plan()
    assert plan is not None and plan.lens == fresh
    gathered = meta.plan(0, window, "continued")
    decodes = sum(1 for q in q_lens if q == 1)
    assert gathered is not None
    assert gathered.seqs == slice(decodes, len(q_lens) - len(fresh))


def test_a_step_ending_in_a_continued_chunk_has_no_fresh_plan():
    meta = _compare(4, 2, 16, None, [B, 6], seq_lens=[B, 30])
    assert meta.fresh_plan() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bf16_mixed_step(dtype):
    _compare(8, 2, 32, 48, [70, 90, 3 * B], seq_lens=[150, 90, 3 * B], dtype=dtype, tol=2e-2)
