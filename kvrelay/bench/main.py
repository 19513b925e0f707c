"""`kvrelay bench serve` (the serving benchmark) and `kvrelay bench compare A.json B.json`.

Flags keep vLLM `bench serve`'s names and meanings; see docs/bench.md.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.bench import datasets, plot, report
from kvrelay.bench.client import ENDPOINTS, RequestOptions, list_models
from kvrelay.bench.metrics import METRIC_NAMES, compute_metrics, output_timeline, parse_goodput
from kvrelay.bench.runner import RunConfig, run_blocking
from kvrelay.bench.tokens import HFTokenCounter, choose_counter
from kvrelay.cli_flags import HelpFormatter

logger = logging.getLogger("kvrelay.bench")
DATASETS = ("random", "prefix_repetition", "sharegpt", "sonnet")
BACKEND_ENDPOINTS = {"vllm": "/v1/completions", "openai": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="benchmark an OpenAI-compatible server",
                       description="Benchmark online serving (vLLM bench serve's flags and "
                                   "metrics; docs/bench.md). Lengths are in tokens of "
                                   "--tokenizer,\nelse of the served model's tokenizer where "
                                   "it is on this machine, else in words (about one token "
                                   "each).",
                       formatter_class=HelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, metavar="URL",
                   help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1", help="the server's address (no --base-url)")
    g.add_argument("--port", type=int, default=8000, help="the server's port (no --base-url)")
    g.add_argument("--endpoint", default=None, choices=ENDPOINTS,
                   help="the API path sent to (default: /v1/completions, or --backend's)")
    g.add_argument("--backend", default=None, choices=tuple(BACKEND_ENDPOINTS),
                   help="vLLM's name for the API flavour; openai-chat = --endpoint "
                        "/v1/chat/completions (default: none)")
    g.add_argument("--model", default=None,
                   help="the model field sent (default: the first model of GET /v1/models)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or a model directory: exact prompt lengths; 'words': "
                        "word units (default: the served model's tokenizer, from GET /v1/models, "
                        "where it is on this machine, else words)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="where the prompts come from (docs/bench.md#datasets)")
    d.add_argument("--dataset-path", default=None, metavar="PATH",
                   help="sharegpt JSON or sonnet text (default: bundled)")
    d.add_argument("--num-prompts", type=int, default=1000, metavar="N",
                   help="requests to send (sharegpt multi-turn: turns in all)")
    d.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seeds the datasets and the arrival times")
    d.add_argument("--random-input-len", type=int, default=1024, metavar="N",
                   help="random: prompt length")
    d.add_argument("--random-output-len", type=int, default=128, metavar="N",
                   help="random: output length (max_tokens)")
    d.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="random: lengths drawn uniformly within ± R times the lengths above")
    d.add_argument("--random-prefix-len", type=int, default=0, metavar="N",
                   help="random: tokens shared by every prompt, before its own")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256, metavar="N",
                   help="prefix_repetition: length of each shared prefix")
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256, metavar="N",
                   help="prefix_repetition: length of each prompt's own suffix")
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, metavar="N",
                   help="prefix_repetition: distinct prefixes (prompt i takes prefix i mod N)")
    d.add_argument("--prefix-repetition-output-len", type=int, default=128, metavar="N",
                   help="prefix_repetition: output length (max_tokens)")
    d.add_argument("--sharegpt-output-len", type=int, default=None, metavar="N",
                   help="sharegpt: output length (default: the dataset reply's length)")
    d.add_argument("--sharegpt-multi-turn", action="store_true",
                   help="send a conversation's turns in order, each with the whole history as "
                        "prompt")
    d.add_argument("--sharegpt-max-turns", type=int, default=5, metavar="N",
                   help="sharegpt multi-turn: turns per conversation at most")
    d.add_argument("--sharegpt-max-prompt-len", type=int, default=1024, metavar="N",
                   help="sharegpt: longest prompt kept")
    d.add_argument("--sharegpt-max-total-len", type=int, default=2048, metavar="N",
                   help="sharegpt: longest prompt + output kept")
    d.add_argument("--sonnet-input-len", type=int, default=550, metavar="N",
                   help="sonnet: prompt length")
    d.add_argument("--sonnet-output-len", type=int, default=150, metavar="N",
                   help="sonnet: output length (max_tokens)")
    d.add_argument("--sonnet-prefix-len", type=int, default=200, metavar="N",
                   help="sonnet: length of the instruction and lines every prompt shares")
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                   help="requests (conversations) per second; inf sends all at once")
    r.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of the intervals; 1 = Poisson")
    r.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="requests in flight at most (default: unlimited)")
    r.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (exact output lengths)")
    r.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="the sampling temperature sent")
    o = p.add_argument_group("output")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", metavar="NAMES",
                   help="of ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="50,90,99", metavar="PS",
                   help="comma-separated, e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs, e.g. ttft:200 tpot:50 (default: none)")
    o.add_argument("--save-result", action="store_true",
                   help="write the JSON result (and the PNG figure)")
    o.add_argument("--result-dir", default=".", metavar="DIR",
                   help="where --save-result writes")
    o.add_argument("--result-filename", default=None, metavar="NAME",
                   help="the result's file name (default: from the date, model and dataset)")
    o.add_argument("--no-plot", action="store_true", help="with --save-result: no PNG figure")
    o.add_argument("--label", default=None, help="a label stored in the JSON result")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    o.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="only compare two saved results (same as kvrelay bench compare)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay bench", description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="COMMAND", help="kvrelay bench COMMAND --help: its flags")
    _serve_parser(sub)
    c = sub.add_parser("compare", help="side-by-side table of two saved results, with ratios",
                       formatter_class=HelpFormatter)
    c.add_argument("a", metavar="A.json", help="the first result (kvrelay bench serve "
                                               "--save-result)")
    c.add_argument("b", metavar="B.json", help="the second result; ratios are B / A")
    return parser


@dataclass(frozen=True)
class OutputConfig:
    percentile_metrics: list[str]
    percentiles: list[float]
    slos: dict[str, float]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OutputConfig:
        names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        bad = [m for m in names if m not in METRIC_NAMES]
        if bad:
            raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)} (choose from "
                             f"{','.join(METRIC_NAMES)})")
        try:
            ps = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--metric-percentiles: {args.metric_percentiles!r} is not a list of "
                             "numbers") from None
        if any(not 0 < p < 100 for p in ps):
            raise ValueError("--metric-percentiles must each lie in (0, 100)")
        return cls(names, ps, parse_goodput(args.goodput))


def build_dataset(args: argparse.Namespace,
                  counter: datasets.Counter) -> list[datasets.Conversation]:
    n, seed = args.num_prompts, args.seed
    if n < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset_name == "random":
        return datasets.random_dataset(counter, n, args.random_input_len, args.random_output_len,
                                       args.random_range_ratio, args.random_prefix_len, seed)
    if args.dataset_name == "prefix_repetition":
        return datasets.prefix_repetition_dataset(
            counter, n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, seed)
    if args.dataset_name == "sonnet":
        return datasets.sonnet_dataset(counter, n, args.sonnet_input_len, args.sonnet_output_len,
                                       args.sonnet_prefix_len, seed, args.dataset_path)
    limits = datasets.ShareGPTLimits(max_prompt_len=args.sharegpt_max_prompt_len,
                                     max_total_len=args.sharegpt_max_total_len)
    return datasets.sharegpt_dataset(counter, n, args.sharegpt_output_len, seed, args.dataset_path,
                                     args.sharegpt_multi_turn, args.sharegpt_max_turns, limits)


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def _models(base_url: str) -> list[dict[str, Any]]:
    import httpx
    async with httpx.AsyncClient(trust_env=False) as client:
        return await list_models(client, base_url)


def _model_and_counter(args: argparse.Namespace,
                       base_url: str) -> tuple[str, datasets.Counter, str]:
    """(model, counter, which tokenizer counts): --model, else the first of GET /v1/models;
    the counter from --tokenizer, else the served model's tokenizer (tokens.choose_counter)."""
    import httpx
    entries: list[dict[str, Any]] | None = None
    model: str = args.model
    if args.model is None:
        entries = asyncio.run(_models(base_url))
        if not entries:
            raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
        model = entries[0]["id"]
    elif args.tokenizer is None:
        try:                                  # only to find the tokenizer: words if it fails
            entries = asyncio.run(_models(base_url))
        except (httpx.HTTPError, RuntimeError) as e:
            logger.debug("GET /v1/models: %s", e)
    counter, which = choose_counter(args.tokenizer, entries, model)
    return model, counter, which


def serve(args: argparse.Namespace) -> int:
    if args.compare:
        return compare(*args.compare)
    out_cfg = OutputConfig.from_args(args)
    base_url = _base_url(args)
    endpoint = args.endpoint or BACKEND_ENDPOINTS.get(args.backend or "", "/v1/completions")
    model, counter, which = _model_and_counter(args, base_url)
    convs = build_dataset(args, counter)
    n_requests = sum(len(c) for c in convs)
    print(f"kvrelay bench: {base_url}{endpoint} model={model} dataset={args.dataset_name} "
          f"requests={n_requests} (conversations={len(convs)}) rate={args.request_rate} "
          f"concurrency={args.max_concurrency or 'unlimited'}", flush=True)
    print(f"kvrelay bench: lengths counted in {which}", flush=True)
    cfg = RunConfig(base_url, RequestOptions(endpoint, model, args.ignore_eos, args.temperature),
                    args.request_rate, args.burstiness, args.max_concurrency, args.seed,
                    args.disable_tqdm)
    count = counter.count if isinstance(counter, HFTokenCounter) else None
    outcome = run_blocking(cfg, convs, count)
    metrics = compute_metrics(outcome.results, outcome.duration, out_cfg.percentiles, out_cfg.slos)
    info: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "kvrelay-bench",
        "endpoint_type": "openai-chat" if cfg.options.chat else "openai", "label": args.label,
        "base_url": base_url, "endpoint": endpoint, "model_id": model,
        "tokenizer_id": counter.name if isinstance(counter, HFTokenCounter) else None,
        "dataset_name": args.dataset_name + ("-multi-turn" if args.sharegpt_multi_turn
                                             and args.dataset_name == "sharegpt" else ""),
        "num_prompts": n_requests, "num_conversations": len(convs),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "ignore_eos": args.ignore_eos, "goodput_slos_ms": out_cfg.slos or None,
        "prefix_cache_queries": outcome.prefix_queries, "prefix_cache_hits": outcome.prefix_hits,
        "prefix_cache_hit_rate": outcome.prefix_hit_rate,
        "prefix_cache_sources": list(outcome.prefix_sources),
        "output_throughput_timeline": output_timeline(outcome.results, outcome.duration),
    }
    d = report.result_dict(metrics, outcome.results, out_cfg.percentile_metrics,
                           out_cfg.percentiles, info)
    print(report.summary_table(d, out_cfg.percentile_metrics, out_cfg.percentiles), flush=True)
    if args.save_result:
        path = Path(args.result_dir) / (args.result_filename or report.default_filename(d))
        report.save(d, path)
        print(f"result: {path}")
        if not args.no_plot:
            if plot.available():
                fig = plot.save_figure(outcome.results, outcome.duration, path.with_suffix(".png"),
                                       f"{model} · {d['dataset_name']} · {n_requests} requests")
                print(f"figure: {fig}")
            else:
                print("figure: skipped (matplotlib is not installed; pip install 'kvrelay[bench]')")
    return 0 if metrics.completed else 1


def compare(a: str, b: str) -> int:
    da, db = report.load(a), report.load(b)
    print(report.compare_table(da, db, Path(a).stem[:24], Path(b).stem[:24]))
    print(f"A = {a}\nB = {b}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "compare":
            return compare(args.a, args.b)
        return serve(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvrelay bench {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
