"""`ModelRunner.prepare`: positions, slot mappings and attention metadata of a step,
against the same quantities computed here one token at a time.

    token j of chunk i:  position = start_i + j
                         slot[g]  = table_g[i][position // B] * B + position % B
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.engine.runner import ModelRunner, StepInput
from kvrelay.model.config import GptOssConfig
from kvrelay.model.gpt_oss import GptOssModel
from tests.factories import TINY

NUM_BLOCKS = 64


def _runner(block_size: int, hybrid: bool = True) -> ModelRunner:
    """A runner on a randomly initialised tiny model (prepare never runs the model):
    sliding and full layers, so two KV-cache groups with the hybrid manager."""
    cfg = GptOssConfig.from_dict(TINY | {"model_type": "gpt_oss",
                                         "layer_types": ["sliding_attention", "full_attention"]})
    model = GptOssModel(cfg, dtype=torch.float32, hybrid_kv_cache=hybrid)
    return ModelRunner(model, NUM_BLOCKS, block_size)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return _runner(4)


def expected(step: StepInput, block_size: int) -> dict[str, list]:
    positions, slots = [], [[] for _ in step.block_tables]
    for i, (start, q) in enumerate(zip(step.starts, step.query_lens)):
        for j in range(q):
            pos = start + j
            positions.append(pos)
            for g, tables in enumerate(step.block_tables):
                slots[g].append(tables[i][pos // block_size] * block_size + pos % block_size)
    cu_q = [0]
    for q in step.query_lens:
        cu_q.append(cu_q[-1] + q)
    width = [max(len(t) for t in tables) for tables in step.block_tables]
    padded = [[t + [0] * (w - len(t)) for t in tables]
              for tables, w in zip(step.block_tables, width)]
    return {"positions": positions, "slots": slots, "cu_q": cu_q, "tables": padded,
            "seq_lens": [s + q for s, q in zip(step.starts, step.query_lens)]}


def check(runner: ModelRunner, step: StepInput) -> None:
    ids, positions, meta = runner.prepare(step)
    want = expected(step, runner.block_size)
    assert ids.tolist() == step.token_ids
    assert positions.tolist() == want["positions"]
    assert [s.tolist() for s in meta.slot_mappings] == want["slots"]
    assert meta.query_start_loc.tolist() == want["cu_q"]
    assert meta.seq_lens.tolist() == want["seq_lens"]
    assert [t.tolist() for t in meta.block_tables] == want["tables"]
    assert meta.num_decodes == step.num_decodes and meta.block_size == runner.block_size


def _step(chunks: list[tuple[int, int]], tables: list[list[list[int]]],
          num_decodes: int = 0) -> StepInput:
    """chunks: (start, query length) per sequence; token ids are arbitrary."""
    q_lens = [q for _, q in chunks]
    ids = [(7 * t + 3) % TINY["vocab_size"] for t in range(sum(q_lens))]
    return StepInput(ids, q_lens, [s for s, _ in chunks], tables, [len(ids) - 1], num_decodes)


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9])     # B = 4: around the block edges
def test_prefill_from_zero_at_block_edges(runner, length):
    blocks = [5, 9, 2][:-(-length // 4)]
    step = _step([(0, length)], [[blocks], [blocks]])
    check(runner, step)
    _, positions, meta = runner.prepare(step)
    assert positions.tolist() == list(range(length))
    assert meta.slot_mappings[0][-1].item() == blocks[(length - 1) // 4] * 4 + (length - 1) % 4


def test_chunked_prefill_continues_mid_block(runner):
    # tokens 0-5 are cached (block 7 full, block 3 half); this chunk writes 6..10
    step = _step([(6, 5)], [[[7, 3, 11]], [[7, 3, 11]]])
    check(runner, step)
    _, positions, meta = runner.prepare(step)
    assert positions.tolist() == [6, 7, 8, 9, 10]
    assert meta.slot_mappings[0].tolist() == [14, 15, 44, 45, 46]
    assert meta.seq_lens.tolist() == [11]


def test_mixed_decodes_and_prefill_chunks(runner):
    # two decodes (the second starts a new block), a chunk mid-prompt, a fresh prompt
    tables = [[1, 2], [3, 4, 5], [6, 7, 8], [9]]
    sliding = [[0, 2], [0, 4, 5], [6, 7, 8], [9]]          # blocks out of the window: null
    step = _step([(7, 1), (8, 1), (5, 6), (0, 3)], [tables, sliding], num_decodes=2)
    check(runner, step)
    _, positions, meta = runner.prepare(step)
    assert positions.tolist() == [7, 8, 5, 6, 7, 8, 9, 10, 0, 1, 2]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 8, 11]
    assert meta.slot_mappings[0].tolist()[:2] == [2 * 4 + 3, 5 * 4 + 0]
    assert meta.block_tables[0][3].tolist() == [9, 0, 0]   # zero-padded (the null block)


def test_decode_only_step(runner):
    tables = [[4], [5, 6], [7, 8, 9]]
    step = _step([(0, 1), (4, 1), (11, 1)], [tables, tables], num_decodes=3)
    check(runner, step)
    _, positions, meta = runner.prepare(step)
    assert positions.tolist() == [0, 4, 11]
    assert meta.slot_mappings[0].tolist() == [16, 24, 39]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3] and meta.seq_lens.tolist() == [1, 5, 12]


def test_groups_use_their_own_tables():
    runner = _runner(4)
    assert runner.num_groups == 2
    step = _step([(2, 4)], [[[0, 21]], [[10, 11]]])
    _, _, meta = runner.prepare(step)
    assert meta.slot_mappings[0].tolist() == [2, 3, 84, 85]
    assert meta.slot_mappings[1].tolist() == [42, 43, 44, 45]
    single = _runner(4, hybrid=False)
    assert single.num_groups == 1
    check(single, _step([(2, 4)], [[[10, 11]]]))


@st.composite
def steps(draw) -> tuple[int, StepInput]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_decodes = draw(st.integers(0, 3))
    chunks = [(draw(st.integers(0, 40)), 1) for _ in range(num_decodes)]
    chunks += [(draw(st.integers(0, 40)), draw(st.integers(2, 20)))
               for _ in range(draw(st.integers(0 if num_decodes else 1, 3)))]
    tables = []
    for _ in range(2):
        tables.append([draw(st.lists(st.integers(0, NUM_BLOCKS - 1),
                                     min_size=-(-(s + q) // block_size),
                                     max_size=-(-(s + q) // block_size) + 2))
                       for s, q in chunks])
    return block_size, _step(chunks, tables, num_decodes)


RUNNERS: dict[int, ModelRunner] = {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_any_step_matches_the_per_token_arithmetic(case):
    block_size, step = case
    runner = RUNNERS.get(block_size) or RUNNERS.setdefault(block_size, _runner(block_size))
    check(runner, step)


def test_decode_step_padded_to_a_compiled_batch(runner):
    """`_prepare_decodes(rows, width)` (compiled decode buckets): the real rows as in the
    eager step, padding rows reading the null block with no KV slot, tables as wide as
    asked in a buffer reused by later steps (a narrower later step leaves stale columns
    past its blocks, which no query reads)."""
    tables = [[4], [5, 6, 3]]
    step = _step([(0, 1), (9, 1)], [tables, tables], num_decodes=2)
    ids, positions, meta = runner._prepare_decodes(step, rows=4, width=6)
    assert ids.tolist() == step.token_ids + [0, 0]
    assert positions.tolist() == [0, 9, 0, 0]
    assert meta.slot_mappings[0].tolist() == [16, 3 * 4 + 1, -1, -1]
    assert meta.seq_lens.tolist() == [1, 10, 1, 1]
    assert meta.block_tables[0].tolist() == [[4, 0, 0, 0, 0, 0], [5, 6, 3, 0, 0, 0],
                                             [0] * 6, [0] * 6]
    narrower = _step([(2, 1)], [[[8]], [[8]]], num_decodes=1)
    _, _, meta = runner._prepare_decodes(narrower, rows=4, width=6)
    assert meta.block_tables[0][0, 0].item() == 8 and meta.block_tables[0].shape == (4, 6)
    assert meta.slot_mappings[1].tolist() == [34, -1, -1, -1]
