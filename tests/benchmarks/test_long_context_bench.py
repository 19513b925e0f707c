"""benchmarks/long_context.py: its hand-built sequence at context L is laid out as a real
one. A real prefill of L tokens, its K/V copied into the synthetic sequence's blocks: the
synthetic decode step at position L gives the token (and the logprob) that the real
engine's next decode step gives."""
from __future__ import annotations

import pytest
import torch

from benchmarks import long_context as lc
from kvrelay.sampling_params import SamplingParams
from tests.factories import make_hf_model, save_checkpoint

BLOCK, WINDOW = 4, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The engine tests' tiny model: 4 layers, a sliding window of 8 on even layers."""
    hf = make_hf_model(seed=11, num_hidden_layers=4, sliding_window=WINDOW)
    return save_checkpoint(hf, tmp_path_factory.mktemp("long-context"))


def _real_then_synthetic(engine, length: int) -> tuple[list[int], float, int, float]:
    """(the real request's two tokens, the second's logprob; the synthetic step's token
    and its logprob), the synthetic sequence's K/V copied from the real prefill's."""
    prompt = torch.randint(0, 160, (length,), generator=torch.Generator().manual_seed(length))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    engine.add_request("real", prompt.tolist(), params)
    engine.step()                                                 # the prefill: token 1
    first = engine.scheduler.requests["real"].output_token_ids[0]
    seq = lc.place(engine, "synthetic", length)
    try:
        lc.tile_from(engine, engine.kv.block_ids("real"), length)(engine, seq)
        token = lc.decode_step(engine, seq, first)                # the greedy step, timed path
        logits = engine.executor.execute(lc.step_input(engine, seq, first, greedy=False))
        logprob = float(torch.log_softmax(logits[0], dim=-1)[token])
    finally:
        engine.kv.free("synthetic")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    real = outputs[-1].outputs[0]
    return list(real.token_ids), real.logprobs[1][real.token_ids[1]].logprob, token, logprob


@pytest.mark.parametrize("length", [13, 30])   # 30: sliding-window blocks already released
def test_synthetic_step_matches_the_real_decode(tiny, length):
    engine = lc.build_engine(str(tiny), [length], length + 2, BLOCK, "bfloat16")
    try:
        real, real_logprob, token, logprob = _real_then_synthetic(engine, length)
        assert token == real[1]
        assert logprob == pytest.approx(real_logprob, abs=1e-5)
        engine.assert_no_leaks()
    finally:
        engine.shutdown()


def test_run_tiles_past_the_source_and_frees_its_blocks(tiny):
    """Lengths beyond the tile source, every sliding-window case, the pool sized by
    `blocks_needed`; rows carry the K/V bytes of the layers' windows."""
    lens = [3, 9, 41]
    engine = lc.build_engine(str(tiny), lens, 8, BLOCK, "bfloat16")
    try:
        fill, token = lc.make_filler(engine, "tile", 8, 1.0)
        table = lc.run(engine, lens, steps=2, warmup=1, rounds=2, fill=fill, token=token)
        engine.kv.free(lc.SOURCE_ID)
        engine.assert_no_leaks()
    finally:
        engine.shutdown()
    per_key = 2 * 2 * 16 * 2                     # K and V, 2 KV heads of 16, bf16
    assert [r["context"] for r in table] == lens
    assert [r["steps"] for r in table] == [4, 4, 4]
    # layers 0 and 2 slide (window 8), 1 and 3 attend the whole context (L + 1 keys)
    assert [r["kv_bytes_read"] for r in table] == [
        (2 * min(n + 1, WINDOW) + 2 * (n + 1)) * per_key for n in lens]
    assert table[0]["ratio_to_shortest"] == 1.0
