#!/usr/bin/env python
"""Where one concurrency-1 token goes: engine spans in-process, plus the served ITL.

    python benchmarks/step_profile.py [--model tiny|PATH] [--prompt-len 200] [--tokens 64]
        [--concurrency 1] [--serve] [--parts] [--cpu-time] [--forward-ab] [--out FILE.json]

Engine part: `LLMEngine` in this process runs one greedy request; every stage of its
`step()` is timed with `time.perf_counter_ns` spans (scheduler, step input, runner input
preparation, forward, logits, sampler, scheduler update, detokenizer/outputs, and the
engine→API message: `as_delta` + pickling), and the step's page faults and context
switches (getrusage counts, all threads). Medians over the decode steps, and the
prefill step (the whole prompt in one chunk) of the second, warm request.
`--concurrency N` runs N requests side by side instead (distinct prompts of the same
length): the decode medians are then those of N-sequence steps.
`--parts` also times the forward's modules, summed over the layers (embedding, the two
norms, qkv, rotary, attention, o_proj, router, experts, final norm, LM head); each span
adds ~0.3 µs of its own. With `KVRELAY_COMPILE_DECODE` set (compiled decode steps) the
model's own spans are left out (wrapping a module fails the compiled graph's guards):
`runner.execute` is input preparation + forward + LM head either way.

`--forward-ab` also replays one captured decode step's `model.forward` (the same inputs,
no spans) along three paths in alternation: the whole step in one native call
(`DecodeStack`), the fused decode path layer by layer (`DecoderLayer.fused_decode`), and
the separate modules: the same-run, same-load comparison of those paths.

Served part (--serve): `kvrelay serve` on the same checkpoint, `kvrelay bench serve` at
concurrency 1 with the same lengths; median ITL − the engine's step = the API process,
IPC, SSE and client share of a token.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# as `kvrelay serve` does (cli.py): OpenMP threads spin briefly at barriers, then sleep
# (libgomp's default spins ~15x longer, which keeps the second thread hotter than served)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CONFIGS, ROOT, build_checkpoint, write_result

SPANS: dict[str, int] = defaultdict(int)      # the current step's spans, summed per name
CLOCK = time.perf_counter_ns  # --cpu-time: time.thread_time_ns (1 thread; robust to load)


def _timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS[name] += CLOCK() - t0

    return wrapper


def instrument(engine: Any) -> None:
    runner = engine.runner
    engine.scheduler.schedule = _timed("scheduler.schedule", engine.scheduler.schedule)
    engine.scheduler.update = _timed("scheduler.update", engine.scheduler.update)
    from kvrelay.engine import step_io
    step_io.step_input = _timed("engine.step_input", step_io.step_input)
    engine.output.outputs = _timed("detokenize+outputs", engine.output.outputs)
    engine.sampler.isolated = _timed("sampler", engine.sampler.isolated)
    runner.execute = _timed("runner.execute (prepare+forward+logits)", runner.execute)
    engine.step = _timed("step (total)", engine.step)
    if getattr(runner, "decode_buckets", ()):  # compiled: a wrapped module fails its guards
        return
    runner.prepare = _timed("runner.prepare", runner.prepare)
    model = runner.model
    forward = model.forward
    model.forward = _timed("model.forward", forward)
    model.compute_logits = _timed("logits", model.compute_logits)


# per-step counters of the engine process (all threads), reported as "count <field>": minor
# and major page faults, voluntary and involuntary context switches
RUSAGE_COUNTS = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")


# the forward's modules timed by --parts, by attribute path within a decoder layer
LAYER_PARTS = {
    ("input_layernorm", "forward"): "fwd.norms",
    ("post_attention_layernorm", "forward"): "fwd.norms",
    ("self_attn.qkv", "qk_v"): "fwd.qkv",
    ("self_attn.attn", "forward"): "fwd.attention (kv write + attend)",
    ("self_attn.o_proj", "forward"): "fwd.o_proj",
    ("mlp.router", "forward"): "fwd.router",
    ("mlp.experts", "forward"): "fwd.experts",
}
# wrapped only where the tree has them: the norms' fused residual add
OPTIONAL_PARTS = {
    ("input_layernorm", "add_forward"): "fwd.norms",
    ("post_attention_layernorm", "add_forward"): "fwd.norms",
    # a layer's one step (DecoderLayer.forward): RoPE + KV write + attention, fused or not
    ("self_attn.attn", "rope_attend"): "fwd.rotary+attention",
    # ... and the router + experts (+ all-reduce), fused or not
    ("mlp.experts", "route_forward"): "fwd.router+experts",
    # older trees' fused decode path
    ("self_attn.attn", "rotary_decode"): "fwd.rotary+attention",
    ("mlp.experts", "decode"): "fwd.router+experts",
}
PART_DEPTH = [0]      # a part inside another part (rotate inside rope_attend) is not counted


def _part(name: str, fn: Callable) -> Callable:
    """`_timed` for the forward's parts: only the outermost part running is counted, so a
    part that calls others (the layer's rope_attend calls rotate and the attention on a
    step that is not fused) is timed once."""
    timed = _timed(name, fn)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if PART_DEPTH[0]:
            return fn(*args, **kwargs)
        PART_DEPTH[0] += 1
        try:
            return timed(*args, **kwargs)
        finally:
            PART_DEPTH[0] -= 1

    return wrapper


def instrument_parts(model: Any) -> None:
    def wrap(module: Any, name: str, method: str = "forward") -> None:
        if not hasattr(module, method):  # an older tree (comparison runs): its forward
            method = "forward"
        setattr(module, method, _part(name, getattr(module, method)))

    wrap(model.embed_tokens, "fwd.embedding")
    wrap(model.norm, "fwd.norms")
    if hasattr(model.norm, "add_forward"):
        wrap(model.norm, "fwd.norms", "add_forward")
    wrap(model.lm_head, "logits.lm_head")
    wrap(model.rotary, "fwd.rotary", "rotate")
    for layer in model.layers:
        for (path, method), name in LAYER_PARTS.items():
            wrap(layer.get_submodule(path), name, method)
        for (path, method), name in OPTIONAL_PARTS.items():
            if hasattr(layer.get_submodule(path), method):
                wrap(layer.get_submodule(path), name, method)


def engine_profile(
    model: str,
    prompt_len: int,
    tokens: int,
    engine_args: dict[str, Any],
    parts: bool = False,
    concurrency: int = 1,
    ab: bool = False,
) -> dict[str, Any]:
    import torch

    from kvrelay.config import EngineArgs
    from kvrelay.engine.core import LLMEngine
    from kvrelay.engine.core_stats import engine_stats
    from kvrelay.engine.messages import as_delta
    from kvrelay.sampling_params import SamplingParams

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    start = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=model, **engine_args))
    start = time.perf_counter() - start
    ab_result = forward_ab(engine, concurrency) if ab else None
    instrument(engine)
    if parts and not getattr(engine.runner, "decode_buckets", ()):
        instrument_parts(engine.runner.model)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    steps: list[dict[str, int]] = []
    for rep in range(2):  # the first request warms caches up
        steps.clear()
        for i in range(concurrency):
            # each request its own first token: the second prompt must not be a
            # prefix-cache hit on the first (its prefill is the one reported)
            first = 1 + i + rep * (concurrency + 1)
            prompt = list(range(first, prompt_len + first))
            engine.add_request(f"r{rep}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            SPANS.clear()
            before = resource.getrusage(resource.RUSAGE_SELF)
            outputs = engine.step()
            after = resource.getrusage(resource.RUSAGE_SELF)
            for field in RUSAGE_COUNTS:  # page faults (first touches), context switches
                SPANS[f"count {field}"] = getattr(after, field) - getattr(before, field)
            t0 = CLOCK()
            stats = engine_stats(engine)
            blob = pickle.dumps(("outputs", [as_delta(o) for o in outputs], stats))
            SPANS["message (delta+stats+pickle)"] += CLOCK() - t0
            SPANS["message bytes"] = len(blob)
            steps.append(dict(SPANS))

    def scaled(name: str, value: float) -> float:
        return round(value if "bytes" in name or "count" in name else value / 1e6, 4)

    # the first step is the prompts' prefill (at high concurrency it may take a few: the
    # medians over the ~`tokens` decode steps are not moved by them)
    decode = steps[1:]
    return {
        "decode": {
            name: scaled(name, statistics.median(s.get(name, 0) for s in decode))
            for name in dict.fromkeys(n for s in steps for n in s)  # every span, in order
        },
        "prefill": {name: scaled(name, v) for name, v in steps[0].items()},
        "prompt_tokens": prompt_len,
        "concurrency": concurrency,
        "engine_start_s": round(start, 1),
        "compiled_decode_buckets": list(getattr(engine.runner, "decode_buckets", ())),
        "steps": len(steps),
    } | ({"forward_ab_ms": ab_result} if ab_result else {})


def forward_ab(engine: Any, concurrency: int, rounds: int = 15, calls: int = 20
               ) -> dict[str, Any]:
    """Median time of `model.forward` on one captured decode step in alternating rounds
    (CLOCK: wall, or thread CPU time with --cpu-time) along three paths: the whole step in
    one native call (`DecodeStack`, the default), the fused decode path layer by layer
    (the plan's `decode_stack` off), and the separate modules (its `fused_decode` off as
    well)."""
    import dataclasses

    import torch

    captured: list[tuple[Any, ...]] = []
    model = engine.runner.model
    forward = model.forward

    def capture(*args: Any) -> Any:
        captured.append(args)
        return forward(*args)

    model.forward = capture
    params = engine_sampling(4)
    for i in range(concurrency):
        engine.add_request(f"ab-{i}", list(range(1 + i, 201 + i)), params)
    while engine.has_unfinished_requests():
        engine.step()
    model.forward = forward
    args = captured[-1]  # a decode step (every sequence one token)
    paths = {"stack": (True, True), "layers": (False, True), "separate": (False, False)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    plan = model.plan
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for name, (stack, fused) in paths.items():
                    model.use_plan(dataclasses.replace(plan, decode_stack=stack,
                                                       fused_decode=fused))
                    forward(*args)
                    t0 = CLOCK()
                    for _ in range(calls):
                        forward(*args)
                    times[name].append((CLOCK() - t0) / calls / 1e6)
    finally:
        model.use_plan(plan)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"sequences": int(args[0].shape[0]), "stack_ms": round(med["stack"], 4),
            "fused_ms": round(med["layers"], 4), "separate_ms": round(med["separate"], 4),
            "saved_ms": round(med["separate"] - med["stack"], 4)}


def engine_sampling(tokens: int) -> Any:
    from kvrelay.sampling_params import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def served_itl(model: str, prompt_len: int, tokens: int, serve_args: list[str]) -> dict[str, Any]:
    out_dir = Path(tempfile.mkdtemp(prefix="step-profile-"))
    server = _server_with(model, serve_args, out_dir)
    try:
        server.wait_ready()
        cmd = [
            sys.executable,
            "-m",
            "kvrelay.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--model",
            "bench",
            "--random-input-len",
            str(prompt_len),
            "--random-output-len",
            str(tokens),
            "--num-prompts",
            "8",
            "--max-concurrency",
            "1",
            "--ignore-eos",
            "--save-result",
            "--result-dir",
            str(out_dir),
            "--result-filename",
            "c1.json",
            "--no-plot",
            "--disable-tqdm",
            "--tokenizer",
            model,
        ]
        cpu0, client0 = process_cpu(server.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        cpu1, client1 = process_cpu(server.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        res = json.loads((out_dir / "c1.json").read_text())
        tokens = res["total_output_tokens"]
        per_token = {
            f"cpu_ms_per_token.{name}": round(1e3 * (cpu1[name] - cpu0.get(name, 0)) / tokens, 3)
            for name in cpu1
        }
        per_token["cpu_ms_per_token.bench client"] = round(
            1e3
            * (client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime)
            / tokens,
            3,
        )
        return {
            k: res.get(k)
            for k in ("median_itl_ms", "median_tpot_ms", "median_ttft_ms", "output_throughput")
        } | per_token
    finally:
        server.stop()


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, all threads) of the server process and its children."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {pid: "API process"}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                cmd = (d / "cmdline").read_bytes()
                if b"resource_tracker" not in cmd:
                    names[int(d.name)] = "engine core"
    out: dict[str, float] = {}
    for p, name in names.items():
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _server_with(model: str, serve_args: list[str], out_dir: Path) -> Any:
    import serve_throughput

    old = serve_throughput.SERVER_FLAGS
    serve_throughput.SERVER_FLAGS = [*old, *serve_args]
    try:
        return serve_throughput.Server("kvrelay", Path(model), out_dir / "server.log")
    finally:
        serve_throughput.SERVER_FLAGS = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1, help="requests side by side")
    ap.add_argument("--forward-ab", action="store_true",
                    help="replay one decode step's forward, fused decode path on vs off")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--parts", action="store_true", help="also time the forward's modules")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager for both parts")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="engine spans in CPU time of the (single) compute thread: comparable "
        "across runs on a loaded machine, where wall time measures the queue",
    )
    a = ap.parse_args()
    if a.cpu_time:
        global CLOCK
        CLOCK = time.thread_time_ns
        os.environ["BENCH_THREADS"] = "1"
    model = str(build_checkpoint("tiny", CONFIGS["tiny"])) if a.model == "tiny" else a.model
    room = max(512, a.prompt_len + a.tokens + 16)     # a 512-token prompt needs more than 512
    engine_args: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": room, "max_num_seqs": 64}
    serve_args: list[str] = []
    if a.eager:
        engine_args["enforce_eager"] = True
        serve_args.append("--enforce-eager")
    result: dict[str, Any] = {
        "model": model,
        "load": os.getloadavg(),
        "eager": a.eager,
        "clock": "thread CPU time" if a.cpu_time else "wall",
        "engine_ms": engine_profile(
            model, a.prompt_len, a.tokens, engine_args, a.parts, a.concurrency, a.forward_ab
        ),
    }
    if a.serve:
        result["served"] = served_itl(model, a.prompt_len, a.tokens, serve_args)
    write_result(result, a.out)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
