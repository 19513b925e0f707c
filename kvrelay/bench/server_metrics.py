"""The server's prefix-cache counters, read from its Prometheus `/metrics` around a run.

kvrelay and vLLM both export `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`
(prompt tokens looked up / found), rendered with the `_total` suffix of Prometheus
counters; every label set (engine, data-parallel rank, model) is summed. A kvrelay proxy
has no such counters of its own: its `/health` lists the prefill and decode servers, and
each of those is read instead. Anything else reports n/a.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)

QUERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_counters(text: str, names: tuple[str, ...]) -> float | None:
    """Sum of the samples of the first of `names` present in a Prometheus text page."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m and m.group(1) in names:
            try:
                sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    for name in names:
        if name in sums:
            return sums[name]
    return None


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    queries: float
    hits: float
    sources: tuple[str, ...]        # the /metrics URLs summed


async def _read(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        resp = await client.get(url, timeout=10)
    except httpx.HTTPError as e:
        logger.debug("GET %s: %s", url, e)
        return None
    return resp.text if resp.status_code == 200 else None


async def _backend_urls(client: httpx.AsyncClient, base_url: str) -> list[str]:
    """The servers behind a kvrelay proxy, from its /health body."""
    try:
        resp = await client.get(f"{base_url}/health", timeout=10)
        servers = resp.json().get("servers") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return []
    scheme = base_url.split("://", 1)[0] if "://" in base_url else "http"
    return [f"{scheme}://{s['server']}" for s in servers if isinstance(s, dict) and s.get("server")]


async def snapshot(client: httpx.AsyncClient, base_url: str) -> PrefixCacheSnapshot | None:
    """The summed counters now, or None when no server exposes them."""
    text = await _read(client, f"{base_url}/metrics")
    if text is not None:
        q, h = parse_counters(text, QUERIES), parse_counters(text, HITS)
        if q is not None and h is not None:
            return PrefixCacheSnapshot(q, h, (f"{base_url}/metrics",))
        if "kvrelay_proxy:" not in text:
            return None
    queries = hits = 0.0
    sources: list[str] = []
    for url in await _backend_urls(client, base_url):
        page = await _read(client, f"{url}/metrics")
        if page is None:
            continue
        q, h = parse_counters(page, QUERIES), parse_counters(page, HITS)
        if q is not None and h is not None:
            queries, hits = queries + q, hits + h
            sources.append(f"{url}/metrics")
    return PrefixCacheSnapshot(queries, hits, tuple(sources)) if sources else None


def hit_rate(before: PrefixCacheSnapshot | None, after: PrefixCacheSnapshot | None
             ) -> tuple[float | None, float | None, float | None]:
    """(queries, hits, hit rate) during the run; Nones when not measurable."""
    if before is None or after is None or before.sources != after.sources:
        return None, None, None
    q, h = after.queries - before.queries, after.hits - before.hits
    return q, h, (h / q if q > 0 else None)
