"""The streaming client and the runner against a scripted server (MockTransport)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvrelay.bench import runner, server_metrics
from kvrelay.bench.client import RequestOptions, first_model, send
from kvrelay.bench.datasets import SampleRequest
from tests.bench.fake_server import FakeOpenAI

BASE = "http://fake:8000"


def _patch_client(monkeypatch, fake: FakeOpenAI) -> None:
    monkeypatch.setattr(runner, "_client",
                        lambda cfg, n: httpx.AsyncClient(transport=fake.transport()))


def _req(prompt: str, out: int = 4) -> SampleRequest:
    return SampleRequest(prompt, len(prompt.split()), out)


def test_body_follows_the_endpoint():
    req = SampleRequest("hi there", 2, 7)
    comp = RequestOptions("/v1/completions", "m", ignore_eos=True).body(req)
    assert comp == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, "prompt": "hi there", "max_tokens": 7, "ignore_eos": True}
    chat = RequestOptions("/v1/chat/completions", "m").body(req)
    assert chat["messages"] == [{"role": "user", "content": "hi there"}]
    assert chat["max_completion_tokens"] == 7
    assert "ignore_eos" not in chat
    with pytest.raises(ValueError, match="--endpoint"):
        RequestOptions("/v1/embeddings")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_send_times_every_chunk_and_reads_usage(endpoint):
    fake = FakeOpenAI(step_s=0.01)

    async def go():
        async with httpx.AsyncClient(transport=fake.transport()) as c:
            return await send(c, BASE + endpoint, RequestOptions(endpoint, "m"), _req("a b c", 5),
                              0.0)

    r = asyncio.run(go())
    assert r.success and r.error == ""
    assert (r.prompt_len, r.output_len) == (4, 5)                  # the server's usage wins
    assert r.generated_text == "t0 t1 t2 t3 t4 "
    assert len(r.itl) == 4 and len(r.chunk_times) == 5
    assert r.ttft >= 0.009 and r.latency >= r.ttft + sum(r.itl) - 1e-6
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)


def test_send_without_usage_counts_chunks_or_uses_the_tokenizer():
    fake = FakeOpenAI(step_s=0, usage=False)

    async def go(count=None):
        async with httpx.AsyncClient(transport=fake.transport()) as c:
            return await send(c, BASE + "/v1/completions", RequestOptions(model="m"),
                              _req("x y", 3), 0.0, count)

    r = asyncio.run(go())
    assert r.success and r.output_len == 3 and r.prompt_len == 2
    assert asyncio.run(go(lambda text: 2 * len(text.split()))).output_len == 6


@pytest.mark.parametrize("prompt,error", [("FAIL now", "HTTP 500: scripted failure"),
                                          ("BREAK later", "RuntimeError: engine died")])
def test_send_turns_failures_into_results(prompt, error):
    fake = FakeOpenAI(step_s=0)

    async def go():
        async with httpx.AsyncClient(transport=fake.transport()) as c:
            return await send(c, BASE + "/v1/completions", RequestOptions(model="m"), _req(prompt),
                              0.0)

    r = asyncio.run(go())
    assert not r.success and r.error == error


def test_send_survives_a_refused_connection():
    async def go():
        async with httpx.AsyncClient(trust_env=False) as c:  # port 9 on loopback: nothing listens
            return await send(c, "http://127.0.0.1:9/v1/completions", RequestOptions(model="m"),
                              _req("a"), 0.0)

    r = asyncio.run(go())
    assert not r.success and r.error.startswith("ConnectError")


def test_first_model():
    fake = FakeOpenAI()

    async def go():
        async with httpx.AsyncClient(transport=fake.transport()) as c:
            return await first_model(c, BASE)

    assert asyncio.run(go()) == "fake-model"


def test_run_caps_concurrency_counts_failures_and_reads_the_prefix_cache(monkeypatch):
    fake = FakeOpenAI(step_s=0.005)
    _patch_client(monkeypatch, fake)
    convs = [[_req(f"p{i} " + "w " * 9, 4)] for i in range(7)] + [[_req("FAIL please")]]
    cfg = runner.RunConfig(BASE, RequestOptions(model="m"), max_concurrency=3, disable_tqdm=True)
    out = asyncio.run(runner.run(cfg, convs))
    assert fake.peak == 3
    assert len(out.results) == 8 and sum(r.success for r in out.results) == 7
    assert out.results[-1].error == "HTTP 500: scripted failure"
    assert out.prefix_queries == 70 and out.prefix_hits == 35
    assert out.prefix_hit_rate == pytest.approx(0.5)
    assert out.prefix_sources == (f"{BASE}/metrics",)


def test_run_sends_the_turns_of_a_conversation_one_after_another(monkeypatch):
    fake = FakeOpenAI(step_s=0.005)
    _patch_client(monkeypatch, fake)
    convs = [[_req("a0"), _req("a1"), _req("a2")], [_req("b0"), _req("b1")]]
    cfg = runner.RunConfig(BASE, RequestOptions(model="m"), disable_tqdm=True)
    out = asyncio.run(runner.run(cfg, convs))
    assert [r.success for r in out.results] == [True] * 5
    t = {(ev, p): at for ev, p, at in fake.log}
    assert t[("end", "a0")] <= t[("start", "a1")] and t[("end", "a1")] <= t[("start", "a2")]
    assert t[("start", "b0")] < t[("end", "a0")]                   # conversations overlap
    assert fake.peak == 2


def test_run_paces_arrivals_by_the_request_rate(monkeypatch):
    fake = FakeOpenAI(step_s=0)
    _patch_client(monkeypatch, fake)
    cfg = runner.RunConfig(BASE, RequestOptions(model="m"), request_rate=20.0, seed=3,
                           disable_tqdm=True)
    out = asyncio.run(runner.run(cfg, [[_req(f"q{i}", 1)] for i in range(10)]))
    from kvrelay.bench.arrivals import arrival_offsets
    expected = arrival_offsets(10, 20.0, 1.0, 3)
    assert [r.start_time for r in out.results] == pytest.approx(expected, abs=0.05)


def test_no_metrics_endpoint_reports_na(monkeypatch):
    fake = FakeOpenAI(step_s=0, metrics=False)
    _patch_client(monkeypatch, fake)
    cfg = runner.RunConfig(BASE, RequestOptions(model="m"), disable_tqdm=True)
    out = asyncio.run(runner.run(cfg, [[_req("a")]]))
    assert (out.prefix_queries, out.prefix_hits, out.prefix_hit_rate,
            out.prefix_sources) == (None, None, None, ())


KVRELAY_PAGE = """# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 120.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 30.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
"""  # noqa: E501 -- a metrics page as served


def test_parse_counters_sums_label_sets_and_accepts_both_names():
    assert server_metrics.parse_counters(KVRELAY_PAGE, server_metrics.QUERIES) == 150.0
    assert server_metrics.parse_counters(KVRELAY_PAGE, server_metrics.HITS) == 64.0
    assert server_metrics.parse_counters("vllm:prefix_cache_hits 5\n", server_metrics.HITS) == 5.0
    assert server_metrics.parse_counters("other_metric 1\n", server_metrics.HITS) is None


def test_a_proxy_is_read_through_its_backends():
    pages = {"proxy:8000": "kvrelay_proxy:requests_total 3\n",
             "p1:8100": "vllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 40\n",
             "d1:8200": "vllm:prefix_cache_queries_total 50\nvllm:prefix_cache_hits_total 10\n"}

    def handle(request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "servers": [
                {"role": "prefill", "server": "p1:8100", "healthy": True},
                {"role": "decode", "server": "d1:8200", "healthy": True}]})
        return httpx.Response(200, text=pages[host])

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as c:
            return await server_metrics.snapshot(c, "http://proxy:8000")

    snap = asyncio.run(go())
    assert (snap.queries, snap.hits) == (150.0, 50.0)
    assert snap.sources == ("http://p1:8100/metrics", "http://d1:8200/metrics")
    later = server_metrics.PrefixCacheSnapshot(250.0, 130.0, snap.sources)
    assert server_metrics.hit_rate(snap, later) == (100.0, 80.0, 0.8)
    assert server_metrics.hit_rate(snap, None) == (None, None, None)


# -- progress -------------------------------------------------------------------------------

def test_progress_line_says_done_total_rate_and_time_left():
    assert runner.progress_line(8, 16, 4.0) == (
        "kvrelay bench: 8/16 requests done (50%), 2.00 req/s, 4.0s elapsed, ~4s left")
    assert runner.progress_line(16, 16, 8.0) == (
        "kvrelay bench: 16/16 requests done (100%), 2.00 req/s, 8.0s elapsed")
    assert runner.progress_line(0, 16, 0.0) == (
        "kvrelay bench: 0/16 requests done (0%), 0.00 req/s, 0.0s elapsed")


def test_line_progress_prints_every_interval_and_at_the_end():
    import io
    now = [0.0]
    out = io.StringIO()
    bar = runner.LineProgress(10, out, every_s=5.0, clock=lambda: now[0])
    for t in (1, 2, 6, 7, 8, 12, 13, 14, 15, 16):           # one request ends at each time
        now[0] = float(t)
        bar.update(1)
    bar.close()
    assert out.getvalue().splitlines() == [
        "kvrelay bench: 3/10 requests done (30%), 0.50 req/s, 6.0s elapsed, ~14s left",
        "kvrelay bench: 6/10 requests done (60%), 0.50 req/s, 12.0s elapsed, ~8s left",
        "kvrelay bench: 10/10 requests done (100%), 0.62 req/s, 16.0s elapsed"]


def test_a_run_shows_progress_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    fake = FakeOpenAI(step_s=0)
    _patch_client(monkeypatch, fake)
    cfg = runner.RunConfig(BASE, RequestOptions(model="m"))
    asyncio.run(runner.run(cfg, [[_req(f"q{i}", 1)] for i in range(5)]))
    err = capsys.readouterr().err
    assert err.startswith("kvrelay bench: 5/5 requests done (100%), ") and "\r" not in err
    asyncio.run(runner.run(runner.RunConfig(BASE, RequestOptions(model="m"), disable_tqdm=True),
                           [[_req("q", 1)]]))
    assert capsys.readouterr().err == ""                  # --disable-tqdm: nothing


def test_a_terminal_gets_the_tqdm_bar():
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    out = Tty()
    bar = runner._progress(3, False, out)
    bar.update(3)
    bar.close()
    assert type(bar).__name__ == "tqdm" and "3/3" in out.getvalue()
