"""kvrelay.plan.check: the decisions benchmarks/plan_check.py makes (which topologies to run,
the workload, whether the runs bear the plan out), with exact numbers."""
from __future__ import annotations

import pytest

from kvrelay.plan.capacity import Measured, Workload, plan, queue_wait_s
from kvrelay.plan.check import (
    Run,
    Targets,
    choose_targets,
    neighbour_topologies,
    parse_recommendation,
    planned_ttft_ms,
    run_from_result,
    table,
    verdict,
)
from kvrelay.plan.main import main

M = Measured(prefill_tok_s=1000, decode_tok_s=200, decode_batch=4, itl_at_1_ms=20)
T = Targets(rate=2.0, prompt_len=500, output_len=32, ttft_ms=1000, itl_ms=30)


def run(x: int, y: int, ttft: float, itl: float = 25, completed: int = 10) -> Run:
    return Run(x, y, 10, completed, ttft, ttft, 2 * ttft, itl, itl, 2 * itl, 50.0, 1.9)


def test_neighbours_are_one_server_either_side_within_the_machine():
    assert neighbour_topologies(2, 1, 4) == [(2, 1), (1, 1), (3, 1), (2, 2)]
    assert neighbour_topologies(2, 2, 5) == [(2, 2), (1, 2), (3, 2), (2, 1), (2, 3)]
    # 3P1D is the most a 4-server machine holds: no 4P1D, no 3P2D
    assert neighbour_topologies(3, 1, 4) == [(3, 1), (2, 1)]
    assert neighbour_topologies(1, 1, 2) == [(1, 1)]


def test_targets_from_the_measurement():
    # S = 500 / 1000 = 500 ms; step(1) = 20 ms; lone TTFT = 500 + 30 + 20 = 550 ms
    t = choose_targets(M, handoff_ms=30, prompt_len=500, output_len=32, demand=1.2,
                       ttft_factor=2.0, itl_factor=1.5)
    assert t.rate == pytest.approx(1.2 * 1000 / 500)
    assert t.ttft_ms == pytest.approx(1100)
    assert t.itl_ms == pytest.approx(30)


def test_chosen_targets_make_the_plan_2p1d():
    # demand 1.2: one server has ρ = 1.2, two are an M/D/2 at a = 1.2: C = a²/(2+a) = .45,
    # W = .45 x .5 / (2 x .8) = 140.6 ms; a decode slot is held 32 x 20 ms = .64 s, 1.54 of
    # 4 slots busy (y = 1); TTFT = 500 + 140.6 + 30 + W_d + 20 <= 1100 ms
    t = choose_targets(M, 30, 500, 32, 1.2, 2.0, 1.5)
    p = plan(M, Workload(t.rate, t.prompt_len, t.output_len, t.ttft_ms, t.itl_ms, 30))
    assert p.topology == "2P1D"
    wd = queue_wait_s(2.4, 0.64, 4) * 1e3
    assert p.ttft_ms == pytest.approx(500 + 140.625 + 30 + wd + 20)


def test_meets_needs_every_request_and_both_means():
    assert run(2, 1, 900).meets(T)
    assert not run(2, 1, 1001).meets(T)                 # mean TTFT over
    assert not run(2, 1, 900, itl=31).meets(T)          # mean ITL over
    assert not run(2, 1, 900, completed=9).meets(T)     # a request failed


def test_verdict_the_smallest_meeting():
    runs = [run(2, 1, 900), run(1, 1, 3000), run(3, 1, 700), run(2, 2, 850)]
    assert verdict(runs, T, (2, 1)) == ("2P1D (recommended) meets the targets with the fewest "
                                        "servers: 1P1D misses them")
    runs = [run(2, 2, 900), run(1, 2, 3000), run(2, 1, 1500)]
    assert verdict(runs, T, (2, 2)) == ("2P2D (recommended) meets the targets with the fewest "
                                        "servers: 1P2D, 2P1D miss them")


def test_verdict_recommendation_misses():
    runs = [run(2, 1, 1200), run(1, 1, 3000), run(3, 1, 700)]
    assert verdict(runs, T, (2, 1)) == "2P1D (recommended) MISSES the targets"


def test_verdict_over_provisioned():
    runs = [run(2, 1, 900), run(1, 1, 950)]
    assert verdict(runs, T, (2, 1)) == ("2P1D (recommended) meets the targets, but 1P1D met "
                                        "them with fewer servers: the plan over-provisions")


def test_verdict_recommendation_missing_or_alone():
    assert verdict([run(1, 1, 900)], T, (2, 1)) == "the recommendation was not run"
    assert verdict([run(1, 1, 900)], T, (1, 1)) == ("1P1D (recommended) meets the targets; "
                                                    "no smaller topology was run")


def test_run_from_bench_result_and_table():
    d = {"completed": 24, "mean_ttft_ms": 752.4, "median_ttft_ms": 663.2, "p99_ttft_ms": 1330.0,
         "mean_itl_ms": 25.2, "median_itl_ms": 22.5, "p99_itl_ms": 64.7,
         "output_throughput": 78.4, "request_throughput": 2.45,
         "start_times": [100.0, 104.5, 103.0, 110.0]}   # 3 gaps in 10 s
    r = run_from_result(2, 1, 24, d)
    assert (r.topology, r.servers, r.completed, r.p99_ttft_ms) == ("2P1D", 3, 24, 1330.0)
    assert r.arrival_s == pytest.approx(0.3)
    rows = table([r, run_from_result(1, 1, 24, d | {"completed": 21})], T, (2, 1)).splitlines()
    assert rows[2] == ("| 2P1D (recommended) | 3 | 752 / 663 / 1330 | 25.2 / 22.5 / 64.7 | "
                       "78.4 | 2.45 (0.30) | 24/24 | met |")
    assert rows[3].startswith("| 1P1D | 2 |") and rows[3].endswith("| 21/24 | missed |")


def test_parse_recommendation_from_the_cli(capsys):
    assert main(["--prefill-tok-s", "1000", "--decode-tok-s", "200", "--decode-batch", "4",
                 "--itl-at-1-ms", "20", "--rate", "2.4", "--prompt-len", "500",
                 "--output-len", "32", "--ttft-ms", "1100", "--itl-ms", "30",
                 "--handoff-ms", "30"]) == 0
    # b_max: t(b) = 20 + (20 - 20)(b-1)/3 = 20 ms <= 30 for every b <= 4; prefill 8192 // 500
    assert parse_recommendation(capsys.readouterr().out) == (2, 1, 16, 4)
    with pytest.raises(ValueError):
        parse_recommendation("kvrelay plan: error: missing --rate")


def test_table_with_the_planned_ttft():
    rows = table([run(2, 1, 900), run(1, 1, 3000)], T, (2, 1),
                 {(2, 1): 925.4, (1, 1): float("inf")}).splitlines()
    assert rows[0].endswith("| planned mean TTFT (ms) |") and rows[1] == "|" + "---|" * 9
    assert rows[2].endswith("| met | 925 |") and rows[3].endswith("| missed | unbounded |")


def test_planned_ttft_includes_the_decode_wait():
    # 2P1D as in test_chosen_targets_make_the_plan_2p1d; with 2 decode servers (8 slots, 1.54
    # busy) the decode wait all but vanishes
    w = Workload(2.4, 500, 32, 1100, 30, 30)
    wd = queue_wait_s(2.4, 0.64, 4) * 1e3
    assert planned_ttft_ms(M, w, 2, 1, 4) == pytest.approx(500 + 140.625 + 30 + wd + 20)
    assert planned_ttft_ms(M, w, 2, 2, 4) == pytest.approx(500 + 140.625 + 30 + 20, abs=0.1)
    assert planned_ttft_ms(M, w, 1, 1, 4) == float("inf")
