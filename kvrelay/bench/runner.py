"""Runs a benchmark: arrivals, the concurrency cap, the progress, the server's counters.

Progress (on stderr; none with --disable-tqdm): a tqdm bar on a terminal, else (a log file,
a pipe) a line `kvrelay bench: 8/16 requests done (50%), 2.10 req/s, 3.8s elapsed, ~4s left`
every PROGRESS_EVERY_S and when the last request ends.

    t=0 ─ conversation 0 arrives ─▶ turn 0 ▶ turn 1 ▶ …   (a turn starts when the previous ends)
          conversation 1 arrives at arrival_offsets[1] ─▶ turn 0 ▶ …
    every request first takes a slot of --max-concurrency (when given), then streams.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import httpx
from tqdm import tqdm

from kvrelay import envs
from kvrelay.bench import server_metrics
from kvrelay.bench.arrivals import arrival_offsets
from kvrelay.bench.client import RequestOptions, send
from kvrelay.bench.datasets import Conversation, SampleRequest
from kvrelay.bench.metrics import RequestResult
from kvrelay.bench.transport import StreamingTransport


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    options: RequestOptions
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")


@dataclass
class RunOutcome:
    results: list[RequestResult]          # in dataset order (conversation by conversation)
    duration: float
    prefix_queries: float | None
    prefix_hits: float | None
    prefix_hit_rate: float | None
    prefix_sources: tuple[str, ...]


def _client(cfg: RunConfig, n_requests: int) -> httpx.AsyncClient:
    conns = cfg.max_concurrency or max(1, n_requests)
    headers = {}
    if key := envs.OPENAI_API_KEY.raw():
        headers["Authorization"] = f"Bearer {key}"
    limits = httpx.Limits(max_connections=conns + 4, max_keepalive_connections=conns + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600, connect=30), headers=headers,
                             transport=StreamingTransport(limits=limits), trust_env=False)


PROGRESS_EVERY_S = 10.0


def progress_line(done: int, total: int, elapsed: float) -> str:
    """`kvrelay bench: 8/16 requests done (50%), 2.10 req/s, 3.8s elapsed, ~4s left`."""
    rate = done / elapsed if elapsed > 0 else 0.0
    left = f", ~{(total - done) / rate:.0f}s left" if 0 < done < total and rate > 0 else ""
    pct = 100 * done // total if total else 100
    return (f"kvrelay bench: {done}/{total} requests done ({pct}%), {rate:.2f} req/s, "
            f"{elapsed:.1f}s elapsed{left}")


class LineProgress:
    """tqdm's update/close, written as a `progress_line` every `every_s` seconds and at the
    end: for output that is not a terminal, where a bar's carriage returns pile up."""

    def __init__(self, total: int, file: IO[str], every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.file, self.every_s, self.clock = total, file, every_s, clock
        self.done = self.shown = 0
        self.t0 = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if self.done >= self.total or now - self.last >= self.every_s:
            self._show(now)

    def close(self) -> None:
        if self.shown != self.done:
            self._show(self.clock())

    def _show(self, now: float) -> None:
        self.last, self.shown = now, self.done
        print(progress_line(self.done, self.total, now - self.t0), file=self.file, flush=True)


def _progress(total: int, disable: bool, file: IO[str] | None = None) -> Any:
    """A tqdm bar on a terminal, `LineProgress` lines otherwise; a silent bar when disabled."""
    out = file or sys.stderr
    if disable or out.isatty():
        return tqdm(total=total, disable=disable, file=out, desc="requests", unit="req")
    return LineProgress(total, out)


def run_blocking(cfg: RunConfig, conversations: list[Conversation],
                 count_tokens: Callable[[str], int] | None = None) -> RunOutcome:
    """`run` on uvloop where it is installed (as it is with kvrelay, for uvicorn): the
    client shares the cores with the server it measures, and asyncio's pure-Python event
    loop costs it ~30 % more CPU per streamed chunk."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(cfg, conversations, count_tokens))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run(cfg, conversations, count_tokens))


async def run(cfg: RunConfig, conversations: list[Conversation],
              count_tokens: Callable[[str], int] | None = None) -> RunOutcome:
    n_requests = sum(len(c) for c in conversations)
    url = cfg.base_url + cfg.options.endpoint
    offsets = arrival_offsets(len(conversations), cfg.request_rate, cfg.burstiness, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[list[RequestResult]] = [[] for _ in conversations]
    async with _client(cfg, n_requests) as client:
        before = await server_metrics.snapshot(client, cfg.base_url)
        bar = _progress(n_requests, cfg.disable_tqdm)
        t0 = time.perf_counter()

        async def one(req: SampleRequest) -> RequestResult:
            if slots is None:
                return await send(client, url, cfg.options, req, t0, count_tokens)
            async with slots:
                return await send(client, url, cfg.options, req, t0, count_tokens)

        async def conversation(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            for req in conversations[i]:
                results[i].append(await one(req))
                bar.update(1)

        await asyncio.gather(*(conversation(i) for i in range(len(conversations))))
        duration = time.perf_counter() - t0
        bar.close()
        after = await server_metrics.snapshot(client, cfg.base_url)
    queries, hits, rate = server_metrics.hit_rate(before, after)
    return RunOutcome([r for conv in results for r in conv], duration, queries, hits, rate,
                      after.sources if after and queries is not None else ())
