"""The result figure: TTFT / TPOT / ITL histograms and output throughput over time.

matplotlib is optional (`pip install 'kvrelay[bench]'`); without it the figure is skipped.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from kvrelay.bench.metrics import RequestResult, output_timeline


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def save_figure(results: list[RequestResult], duration: float, path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in ok],
        "TPOT (ms)": [t * 1000 for r in ok if (t := r.tpot) is not None],
        "ITL (ms)": [x * 1000 for r in ok for x in r.itl],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (label, values) in zip(axes.flat, series.items()):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        ax.set_title(f"{label.split()[0]} distribution (n={len(values)})")
    ax = axes.flat[3]
    bucket = max(1.0, round(duration / 60))           # ~60 points whatever the run's length
    timeline = output_timeline(results, duration, bucket)
    ax.plot([(i + 0.5) * bucket for i in range(len(timeline))], timeline, marker=".",
            color="tab:green")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"output throughput over time ({bucket:g} s buckets)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
