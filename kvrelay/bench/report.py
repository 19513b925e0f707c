"""The summary table, the JSON result (vLLM's key names) and `bench compare`."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvrelay.bench.metrics import METRIC_NAMES, BenchmarkMetrics, RequestResult

WIDTH = 50
TITLES = {"ttft": ("Time to First Token", "TTFT"),
          "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
          "itl": ("Inter-token Latency", "ITL"),
          "e2el": ("End-to-end Latency", "E2EL")}


def p_word(p: float) -> str:
    """99 → "99", 99.9 → "99.9" (vLLM's key spelling: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _row(label: str, value: Any, fmt: str = "{:<10.2f}") -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, int):
        text = str(value)
    else:
        text = fmt.format(value)
    return f"{label:<40}{text}"


def _rule(title: str, ch: str = "-") -> str:
    return f"{title:{ch}^{WIDTH}}"


def result_dict(m: BenchmarkMetrics, results: list[RequestResult], percentile_metrics: list[str],
                percentiles: list[float], info: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = dict(info)
    d |= {
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in METRIC_NAMES:
        if name not in percentile_metrics:
            continue
        s = m.summaries[name]
        d[f"mean_{name}_ms"], d[f"median_{name}_ms"], d[f"std_{name}_ms"] = s.mean, s.median, s.std
        for p in percentiles:
            d[f"p{p_word(p)}_{name}_ms"] = s.percentiles[p]
    d |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    return d


def summary_table(d: dict[str, Any], percentile_metrics: list[str],
                  percentiles: list[float]) -> str:
    lines = [_rule(" Serving Benchmark Result ", "="),
             _row("Successful requests:", d["completed"]),
             _row("Failed requests:", d["failed"])]
    if d.get("max_concurrency"):
        lines.append(_row("Maximum request concurrency:", d["max_concurrency"]))
    if d.get("request_rate") not in (None, "inf"):
        lines.append(_row("Request rate configured (RPS):", float(d["request_rate"])))
    lines += [_row("Benchmark duration (s):", d["duration"]),
              _row("Total input tokens:", d["total_input_tokens"]),
              _row("Total generated tokens:", d["total_output_tokens"]),
              _row("Request throughput (req/s):", d["request_throughput"])]
    if d.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", d["request_goodput"]))
    lines += [_row("Output token throughput (tok/s):", d["output_throughput"]),
              _row("Peak output token throughput (tok/s):", d["max_output_tokens_per_s"]),
              _row("Peak concurrent requests:", d["max_concurrent_requests"]),
              _row("Total token throughput (tok/s):", d["total_token_throughput"])]
    for name in METRIC_NAMES:
        if name not in percentile_metrics:
            continue
        title, short = TITLES[name]
        lines.append(_rule(title))
        lines.append(_row(f"Mean {short} (ms):", d[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", d[f"median_{name}_ms"]))
        lines.append(_row(f"Std {short} (ms):", d[f"std_{name}_ms"]))
        for p in percentiles:
            lines.append(_row(f"P{p_word(p)} {short} (ms):", d[f"p{p_word(p)}_{name}_ms"]))
    lines.append(_rule("Prefix Cache (server /metrics)"))
    lines.append(_row("Prefix cache queries (tokens):",
                      _int_or_none(d.get("prefix_cache_queries"))))
    lines.append(_row("Prefix cache hits (tokens):", _int_or_none(d.get("prefix_cache_hits"))))
    rate = d.get("prefix_cache_hit_rate")
    lines.append(_row("Prefix cache hit rate (%):", None if rate is None else 100 * rate))
    lines.append("=" * WIDTH)
    errors = [e for e in d.get("errors", []) if e]
    if errors:
        lines.append(f"first error ({len(errors)} failed): {errors[0]}")
    return "\n".join(lines)


def _int_or_none(x: float | None) -> int | None:
    return None if x is None else round(x)


def default_filename(d: dict[str, Any]) -> str:
    rate = d.get("request_rate", "inf")
    conc = d.get("max_concurrency") or "inf"
    model = str(d.get("model_id", "model")).replace("/", "_")
    return f"kvrelay-{d.get('dataset_name', 'bench')}-{rate}qps-c{conc}-{model}-{d['date']}.json"


def save(d: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=2, default=_json_default))
    return path


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# --------------------------------------------------------------------------- compare

COMPARE_KEYS = (
    ("completed", "Successful requests", False),
    ("failed", "Failed requests", True),
    ("duration", "Duration (s)", True),
    ("total_input_tokens", "Total input tokens", None),
    ("total_output_tokens", "Total generated tokens", None),
    ("request_throughput", "Request throughput (req/s)", False),
    ("request_goodput", "Request goodput (req/s)", False),
    ("output_throughput", "Output throughput (tok/s)", False),
    ("total_token_throughput", "Total throughput (tok/s)", False),
)


def compare_table(a: dict[str, Any], b: dict[str, Any], name_a: str = "A",
                  name_b: str = "B") -> str:
    """Side by side with B/A; "better" says which side wins on that row (lower is better for
    latencies, higher for throughputs)."""
    rows: list[tuple[str, Any, Any, bool | None]] = [(label, a.get(k), b.get(k), low)
                                                     for k, label, low in COMPARE_KEYS]
    for name in METRIC_NAMES:
        percentiles = {k.split("_")[0] for k in a
                       if k.endswith(f"_{name}_ms") and k.startswith("p")}
        for stat in ("mean", "median") + tuple(sorted(percentiles, key=lambda s: float(s[1:]))):
            key = f"{stat}_{name}_ms"
            if key in a or key in b:
                rows.append((f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} "
                             f"{name.upper()} (ms)", a.get(key), b.get(key), True))
    if "prefix_cache_hit_rate" in a or "prefix_cache_hit_rate" in b:
        pa, pb = a.get("prefix_cache_hit_rate"), b.get("prefix_cache_hit_rate")
        rows.append(("Prefix cache hit rate (%)", None if pa is None else 100 * pa,
                     None if pb is None else 100 * pb, False))
    w = max(12, len(name_a), len(name_b))
    head = f"{'metric':<34}{name_a:>{w}}  {name_b:>{w}}  {'B/A':>7}  better"
    out = [head, "-" * len(head)]
    for label, va, vb, low in rows:
        ratio = vb / va if _num(va) and _num(vb) and va != 0 else None
        better = ""
        if low is not None and _num(va) and _num(vb) and va != vb:
            better = name_a if (va < vb) == low else name_b
        ratio_text = _fmt(ratio, "{:.3f}")
        out.append(f"{label:<34}{_fmt(va):>{w}}  {_fmt(vb):>{w}}  {ratio_text:>7}  {better}")
    return "\n".join(out)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fmt(x: Any, f: str = "{:.2f}") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f.format(x)
    return str(x)


def load(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read benchmark result {path}: {e}") from None
