"""`kvrelay plan`: the queueing arithmetic with exact numbers, bench files as inputs, CLI errors."""
from __future__ import annotations

import json
import math

import pytest

from kvrelay.plan.capacity import (
    Measured,
    PlanError,
    Workload,
    decode_from_result,
    erlang_c,
    neighbours,
    plan,
    prefill_from_result,
    prefill_ttft_ms,
    queue_wait_s,
    step_ms,
)
from kvrelay.plan.main import main

M = Measured(prefill_tok_s=1000, decode_tok_s=400, decode_batch=16, itl_at_1_ms=20)


def test_erlang_c_and_the_md_c_wait():
    # c = 1: an arrival waits with probability a (= ρ), and the wait is M/D/1's ρS/(2(1-ρ))
    assert erlang_c(1, 0.6) == pytest.approx(0.6)
    assert queue_wait_s(1.2, 0.5, 1) == pytest.approx(0.6 * 0.5 / (2 * 0.4))
    # c = 2: C = a² / (2 + a); a = 1.5 → 9/14
    assert erlang_c(2, 1.5) == pytest.approx(9 / 14)
    assert queue_wait_s(3, 0.5, 2) == pytest.approx(9 / 14 * 0.5 / (2 * 0.5))
    assert queue_wait_s(3, 0.5, 1) == math.inf


def test_prefill_count_is_the_smallest_meeting_ttft():
    # S = 0.5 s, λ = 3/s: a = 1.5 servers busy. x=1: ρ = 1.5, unbounded. x=2: ρ = .75,
    # W = (9/14) x .5 / (2 x .5) = 321.4 ms. Decode: b_max 16 (t(16) = 40 <= 50 ms), a slot held
    # T = 100 x 40 ms = 4 s, N = 12 busy of 16 (ρ = .75 <= .8): y = 1, W_d = M/D/16 wait
    w = Workload(rate=3, prompt_len=500, output_len=100, ttft_ms=1000, itl_ms=50)
    wd = queue_wait_s(3, 4.0, 16) * 1e3
    assert 100 < wd < 105
    assert prefill_ttft_ms(M, w, 2, wd) == pytest.approx((0.75, 500 + 9 / 14 * 500 + wd + 20))
    p = plan(M, w)
    assert (p.prefill, p.decode, p.decode_max_num_seqs) == (2, 1, 16)
    assert p.ttft_ms == pytest.approx(500 + 9 / 14 * 500 + wd + 20)
    assert any("x=1" in line and "misses" in line for line in p.lines)
    assert neighbours(M, w, p) == ["1P1D: prefill ρ = 1.50, TTFT ≈ unbounded (ρ >= 1) "
                                   "(target 1000)"]
    # a tighter target: the wait at x=2 (944 ms in all) misses 900 ms, x=3 meets it
    p = plan(M, Workload(rate=3, prompt_len=500, output_len=100, ttft_ms=900, itl_ms=50))
    assert p.topology == "3P1D"


def test_decode_slots_are_kept_under_max_util():
    # t(16) = 16/400 = 40 ms; t(b) = 20 + 20(b-1)/15 <= 30 → b <= 8.5: b_max 8
    w = Workload(rate=3, prompt_len=500, output_len=100, ttft_ms=1000, itl_ms=30)
    assert step_ms(M, 16) == pytest.approx(40.0) and step_ms(M, 1) == pytest.approx(20.0)
    p = plan(M, w)
    # a slot is held T = 100 x t(8) (29.33 ms) = 2.93 s; N = 3 x 2.93 = 8.8 slots busy:
    # y = ceil(8.8 / (0.8 x 8)) = 2 (one server's 8 slots would be 110 % busy)
    assert (p.decode, p.decode_max_num_seqs) == (2, 8)
    assert p.prefill_max_num_seqs == 8192 // 500
    assert p.topology == "2P2D"
    assert neighbours(M, w, p)[1] == ("2P1D: decode slots ρ = 1.10 (max 0.8), TTFT ≈ unbounded "
                                      "(ρ >= 1) (target 1000)")
    # 7 slots busy of 8 (ρ = .875 > .8) also needs a second server, though N < b_max
    p = plan(M, Workload(rate=3, prompt_len=500, output_len=80, ttft_ms=1000, itl_ms=30))
    assert p.decode == 2


def test_a_long_decode_wait_adds_decode_servers():
    # y=1 by utilisation (12 of 16 slots), but its wait (102 ms) leaves no x meeting 620 ms:
    # S 500 + W_d 102 + step 20 > 620. y=2 (wait < 1 ms): x=3 (W = 39 ms, TTFT 559 ms)
    w = Workload(rate=3, prompt_len=500, output_len=100, ttft_ms=620, itl_ms=50)
    p = plan(M, w)
    assert p.topology == "3P2D" and p.ttft_ms == pytest.approx(559, abs=1)
    # y = 1 (no x), 2 (x = 3), 3 (could x be 1? no: 3P3D); not 4
    assert [ln.split(":")[0] for ln in p.lines if ln.startswith("  y=")] == ["  y=1", "  y=2",
                                                                            "  y=3"]


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
    assert rc == 0 and "recommendation: 2P2D" in out and "--max-num-seqs 8" in out


def test_cli_errors_are_one_line(capsys):
    assert main(["--ttft-ms", "100", "--itl-ms", "10", "--rate", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay plan: error: missing --prefill-tok-s") and err.count("\n") == 1
    assert main(["--prefill-tok-s", "1", "--decode-tok-s", "1", "--decode-batch", "1", "--rate",
                 "-1", "--prompt-len", "1", "--output-len", "1", "--ttft-ms", "1",
                 "--itl-ms", "1"]) == 2
    assert "rate must be positive" in capsys.readouterr().err
    assert not math.isnan(step_ms(Measured(1, 1, 1), 1))


def test_decode_rate_is_batch_over_itl(tmp_path):
    # behind a proxy each request waits ~its prefill for its first token, so output_throughput
    # (100) under-states the decode server; at batch 4 with a 25 ms ITL it makes 160 tok/s
    f = tmp_path / "decode.json"
    f.write_text(json.dumps({"completed": 12, "max_concurrency": 4, "output_throughput": 100.0,
                             "mean_itl_ms": 25.0, "median_itl_ms": 24.0}))
    assert decode_from_result(str(f)) == pytest.approx((160.0, 4, 25.0))
    f.write_text(json.dumps({"completed": 12, "max_concurrency": 4, "output_throughput": 100.0}))
    assert decode_from_result(str(f)) == pytest.approx((100.0, 4, 0.0))
