"""`kvrelay bench serve` as a subprocess against a real `kvrelay serve` on loopback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import Server


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "128", "--block-size", "4",
                              "--enable-prefix-caching", "--served-model-name", "tiny"],
               tmp_path_factory.mktemp("bench-server") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def bench(*args: str, timeout: float = 240, progress: bool = False) -> subprocess.CompletedProcess:
    quiet = [] if progress else ["--disable-tqdm"]
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "serve", *quiet, *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_prefix_repetition_run_against_kvrelay(server, tiny, tmp_path):
    r = bench("--base-url", server.url, "--dataset-name", "prefix_repetition", "--tokenizer",
              str(tiny[0]),
              "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "8",
              "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "6",
              "--num-prompts", "8", "--max-concurrency", "2", "--ignore-eos", "--seed", "1",
              "--goodput", "e2el:60000", "--save-result", "--result-dir", str(tmp_path),
              "--result-filename", "run.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout
    d = json.loads((tmp_path / "run.json").read_text())
    assert d["model_id"] == "tiny"                          # the first of GET /v1/models
    assert d["completed"] == 8 and d["failed"] == 0
    assert d["total_output_tokens"] == 8 * 6                 # usage counts, ignore_eos
    assert d["input_lens"] == [40] * 8                       # exact with the tokenizer
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                "mean_e2el_ms", "ttfts", "itls", "errors"):
        assert key in d, key
    assert all(len(x) == 5 for x in d["itls"])
    assert d["prefix_cache_hit_rate"] > 0 and d["prefix_cache_hits"] > 0
    assert d["prefix_cache_queries"] >= 8 * 40
    if (tmp_path / "run.png").exists() is False:
        assert "figure: skipped" in r.stdout


def test_chat_random_without_tokenizer_counts_with_the_served_models(server, tiny):
    """No --tokenizer: the served model's (GET /v1/models' root, under --served-model-name
    tiny), and the output says so; progress lines on stderr (not a terminal)."""
    r = bench("--base-url", server.url, "--endpoint", "/v1/chat/completions", "--dataset-name",
              "random",
              "--random-input-len", "12", "--random-output-len", "4", "--num-prompts", "4",
              "--request-rate", "50", "--ignore-eos", progress=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Successful requests:                    4" in r.stdout
    assert "Failed requests:                        0" in r.stdout
    assert "Total generated tokens:                 16" in r.stdout
    assert (f"kvrelay bench: lengths counted in tokens of the served model's tokenizer, "
            f"{tiny[0]} (from GET /v1/models; --tokenizer overrides)") in r.stdout
    assert "kvrelay bench: 4/4 requests done (100%), " in r.stderr, r.stderr


def test_random_prompts_are_exact_in_the_served_models_tokens(server, tiny, tmp_path):
    r = bench("--base-url", server.url, "--dataset-name", "random", "--random-input-len", "12",
              "--random-output-len", "2", "--num-prompts", "3", "--ignore-eos", "--save-result",
              "--no-plot", "--result-dir", str(tmp_path), "--result-filename", "run.json")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((tmp_path / "run.json").read_text())
    assert d["input_lens"] == [12] * 3                       # the server's usage agrees
    assert d["tokenizer_id"] == str(tiny[0])
    r = bench("--base-url", server.url, "--dataset-name", "random", "--random-input-len", "12",
              "--random-output-len", "2", "--num-prompts", "1", "--tokenizer", "words")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lengths counted in words, about one token each (--tokenizer words)" in r.stdout
