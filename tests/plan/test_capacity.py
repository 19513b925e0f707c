"""`kvrelay plan`: the queueing arithmetic with exact numbers, bench files as inputs, CLI errors."""
from __future__ import annotations

import json
import math

import pytest

from kvrelay.plan.capacity import (
    Measured,
    PlanError,
    Workload,
    neighbours,
    plan,
    prefill_from_result,
    prefill_ttft_ms,
    step_ms,
)
from kvrelay.plan.main import main

M = Measured(prefill_tok_s=1000, decode_tok_s=400, decode_batch=16, itl_at_1_ms=20)


def test_prefill_count_is_the_smallest_meeting_ttft():
    # S = 0.5 s per prompt, λ = 3/s: 1.5 servers busy. x=2: ρ = .75 > .8? no, .75 <= .8;
    # W = .75 x .5 / (2 x .25) = .75 s; TTFT = 500 + 750 + 20 = 1270 ms > 1000 → x=3:
    # ρ = .5, W = .25 s, TTFT = 500 + 250 + 20 = 770 ms
    w = Workload(rate=3, prompt_len=500, output_len=100, ttft_ms=1000, itl_ms=50)
    assert prefill_ttft_ms(M, w, 2) == pytest.approx((0.75, 1270.0))
    assert prefill_ttft_ms(M, w, 3) == pytest.approx((0.5, 770.0))
    p = plan(M, w)
    assert p.prefill == 3 and p.ttft_ms == pytest.approx(770.0)
    assert any("x=2" in line and "misses" in line for line in p.lines)
    assert "2P" in neighbours(M, w, p)[0] and "1270 ms" in neighbours(M, w, p)[0]


def test_decode_count_from_littles_law_and_the_itl_bound():
    # t(16) = 16/400 = 40 ms; t(b) = 20 + 20(b-1)/15 <= 30 → b <= 8.5: b_max 8
    w = Workload(rate=3, prompt_len=500, output_len=100, ttft_ms=1000, itl_ms=30)
    assert step_ms(M, 16) == pytest.approx(40.0) and step_ms(M, 1) == pytest.approx(20.0)
    p = plan(M, w)
    # N = 3 x 100 x t(8) (= 29.33 ms) = 8.8 sequences → y = ceil(8.8 / 8) = 2
    assert (p.decode, p.decode_max_num_seqs) == (2, 8)
    assert p.prefill_max_num_seqs == 8192 // 500
    assert p.topology == "3P2D"


def test_impossible_targets_say_why():
    with pytest.raises(PlanError, match="alone takes 2000 ms"):
        plan(M, Workload(rate=0.1, prompt_len=2000, output_len=10, ttft_ms=1000, itl_ms=50))
    with pytest.raises(PlanError, match="ITL at batch 1"):
        plan(M, Workload(rate=1, prompt_len=100, output_len=10, ttft_ms=1000, itl_ms=10))
    one_point = Measured(1000, 400, 16)
    with pytest.raises(PlanError, match="over the 30 ms target"):
        plan(one_point, Workload(rate=1, prompt_len=100, output_len=10, ttft_ms=1000, itl_ms=30))


def test_inputs_from_bench_result_files(tmp_path, capsys):
    pre = tmp_path / "prefill.json"
    pre.write_text(json.dumps({"completed": 2, "input_lens": [300, 700], "ttfts": [0.3, 0.7]}))
    assert prefill_from_result(str(pre)) == pytest.approx(1000.0)
    dec = tmp_path / "decode.json"
    dec.write_text(json.dumps({"completed": 8, "max_concurrency": 16, "output_throughput": 400.0,
                               "median_itl_ms": 40}))
    wl = tmp_path / "workload.json"
    wl.write_text(json.dumps({"completed": 2, "request_rate": 3.0, "input_lens": [400, 600],
                              "output_lens": [50, 150]}))
    rc = main(["--prefill-result", str(pre), "--decode-result", str(dec), "--workload", str(wl),
               "--itl-at-1-ms", "20", "--ttft-ms", "1000", "--itl-ms", "30"])
    out = capsys.readouterr().out
    assert rc == 0 and "recommendation: 3P2D" in out and "--max-num-seqs 8" in out


def test_cli_errors_are_one_line(capsys):
    assert main(["--ttft-ms", "100", "--itl-ms", "10", "--rate", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay plan: error: missing --prefill-tok-s") and err.count("\n") == 1
    assert main(["--prefill-tok-s", "1", "--decode-tok-s", "1", "--decode-batch", "1", "--rate",
                 "-1", "--prompt-len", "1", "--output-len", "1", "--ttft-ms", "1",
                 "--itl-ms", "1"]) == 2
    assert "rate must be positive" in capsys.readouterr().err
    assert not math.isnan(step_ms(Measured(1, 1, 1), 1))
