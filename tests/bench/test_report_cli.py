"""JSON result keys, the summary table, `bench compare`, CLI errors, and no torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrelay.bench import report
from kvrelay.bench.main import main
from kvrelay.bench.metrics import RequestResult, compute_metrics

VLLM_KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
             "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
             "ttfts", "itls", "input_lens", "output_lens", "errors", "generated_texts"]


def _results() -> list[RequestResult]:
    return [RequestResult(True, 10, 3, 0.1, [0.05, 0.05], 0.2, 0.0, [0.1, 0.15, 0.2], "abc"),
            RequestResult(False, 10, 0, 0.0, [], 0.01, 0.0, [], "", "HTTP 500: nope")]


def test_result_dict_uses_vllms_keys_and_the_table_shows_them():
    res = _results()
    m = compute_metrics(res, 1.0, [50, 99.9])
    d = report.result_dict(m, res, ["ttft", "tpot", "itl", "e2el"], [50, 99.9],
                           {"max_concurrency": 4, "request_rate": "inf",
                            "prefix_cache_hit_rate": 0.25,
                            "prefix_cache_queries": 100.0, "prefix_cache_hits": 25.0})
    for key in VLLM_KEYS + ["p50_ttft_ms", "p99.9_ttft_ms"]:
        if key not in ("p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms"):
            assert key in d, key
    assert d["completed"] == 1 and d["failed"] == 1 and d["errors"] == ["", "HTTP 500: nope"]
    assert d["median_ttft_ms"] == pytest.approx(100.0)
    table = report.summary_table(d, ["ttft", "tpot", "itl", "e2el"], [50, 99.9])
    assert "Successful requests:                    1" in table
    assert "P99.9 TTFT (ms):" in table and "Mean E2EL (ms):" in table
    assert "Prefix cache hit rate (%):              25.00" in table
    assert "first error (1 failed): HTTP 500: nope" in table
    json.dumps(d)


def test_table_says_na_without_prefix_counters():
    res = _results()[:1]
    d = report.result_dict(compute_metrics(res, 1.0, [99]), res, ["ttft"], [99], {})
    assert "Prefix cache hit rate (%):              n/a" in report.summary_table(d, ["ttft"], [99])


def test_compare_prints_ratios(tmp_path, capsys):
    a = {"completed": 10, "failed": 0, "output_throughput": 100.0, "mean_ttft_ms": 50.0,
         "median_ttft_ms": 40.0, "p99_ttft_ms": 90.0, "prefix_cache_hit_rate": None}
    b = a | {"output_throughput": 150.0, "mean_ttft_ms": 25.0, "p99_ttft_ms": 45.0,
             "prefix_cache_hit_rate": 0.5}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("Output throughput"))
    assert row.split()[-3:] == ["150.00", "1.500", "b"]
    row = next(line for line in out.splitlines() if line.startswith("P99 TTFT"))
    assert row.split()[-2:] == ["0.500", "b"]
    assert "n/a" in next(line for line in out.splitlines() if line.startswith("Prefix cache"))
    assert main(["serve", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0


@pytest.mark.parametrize("argv,message", [
    (["serve", "--goodput", "ttft"], "--goodput"),
    (["serve", "--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["serve", "--metric-percentiles", "50,100"], "--metric-percentiles"),
    (["compare", "/nonexistent/a.json", "/nonexistent/b.json"], "cannot read benchmark result"),
])
def test_flag_errors_exit_one_with_a_message(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_unknown_flag_exits_two(capsys):
    assert main(["serve", "--no-such-flag"]) == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_the_bench_imports_no_torch():
    code = ("import sys, kvrelay.bench.main, kvrelay.bench.runner, kvrelay.bench.plot, "
            "kvrelay.bench.tokens; kvrelay.bench.main.build_parser(); assert 'torch' not in "
            "sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
