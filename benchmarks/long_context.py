#!/usr/bin/env python
"""kvrelay's c=1 decode step at long context, without running the long prefill.

    python benchmarks/long_context.py [--model PATH] [--lens 200,2048,8192,16384]
        [--steps 32] [--warmup 4] [--rounds 1] [--threads N] [--fill tile|random]
        [--source-len 256] [--out FILE.json]

A decode step's cost does not depend on the KV values it reads, so each context length L
gets one sequence whose first L tokens' K/V are written straight into its KV blocks
instead of computed by a prefill (a 16k-token prefill of the 20b shape takes ~20 min on
2 cores). Everything else is what `kvrelay serve` runs: an `LLMEngine` built in this
process from `EngineArgs` (the same execution plan, native kernels, decode stack / fused
decode, screened greedy head, warm-up), the sequence's blocks allocated by the engine's
`KVCacheManager` as the scheduler allocates a decode's, and each step a `StepInput`
through the engine's executor (`ModelRunner.execute`: input preparation, forward, LM
head), its token picked as the greedy sampler picks it.

The sequence at context L, block size B, sliding window W (one decode token at position L):

    positions         0 .. L-1 (synthetic K/V)      L (this step's token: written, then read)
    full group        table [b0, b1, ..., b_ceil((L+1)/B)-1]   reads L + 1 keys per layer
    sliding group     table [null, ..., null, b_f, ...]        reads min(L + 1, W) keys
                      f = max(L + 1 - W, 0) // B  (blocks before f released, as
                      KVCacheManager._skip_out_of_window releases them)
    step input        token_ids [t], query_lens [1], starts [L], logits_rows [0],
                      num_decodes 1, greedy (a plain greedy request's step)

Every timed step is that same decode at position L (its K/V rewritten into the same slot),
fed the previous step's token; `--warmup` untimed steps come first. `--rounds R` times the
lengths in turn R times (all sequences held at once), for a drifting shared machine.

K/V fill (`--fill`): `tile` (default) runs one real prefill of `--source-len` tokens (a
hand-built prefill step through the same runner) and copies its blocks, block i of each
group from source block i (i < source blocks) or i mod (source blocks), so every block
holds K/V of realistic scale; `random` writes N(0, `--kv-std`) in the cache's dtype.

Per L: median / p10 / p90 step ms, tokens/s, tok/s ÷ tok/s at the smallest L, bytes of K/V
read per step (full-attention layers L + 1 keys, sliding layers min(L + 1, W)) beside the
weights read per step (experts at top-k of E; one embedding row; the LM head at its
weight's size, though the screened greedy head reads its int8 copy plus a few rows).
The target it checks (issue 28): decode at the longest L ≥ 0.6× its speed at the shortest
(20b shape, c=1: 16384 vs 200).

Without `--model` it runs the benchmarks' tiny config (a smoke run, not a measurement).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# as `kvrelay serve` does (cli.py): OpenMP threads spin briefly at barriers, then sleep
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402 -- after the OpenMP setting

from benchmarks.common import CONFIGS, build_checkpoint, cpu_model, git_sha, log  # noqa: E402

DEFAULT_LENS = (200, 2048, 8192, 16384)
TARGET_RATIO = 0.6           # issue 28: tok/s at 16k ≥ 0.6 × tok/s at 200 (20b shape, c=1)
SOURCE_ID = "long-context-source"

Filler = Callable[[Any, "SyntheticSequence"], None]


@dataclass
class SyntheticSequence:
    """One synthetic sequence: its id in the engine's KV manager and its context length L
    (tokens whose K/V sit in its blocks; the decode step is at position L)."""

    request_id: str
    length: int


# -- engine and sequences -----------------------------------------------------------------------
def blocks_needed(length: int, block_size: int, windows: list[int | None]) -> int:
    """Blocks a sequence decoding at position `length` holds, over the groups' windows
    (what `KVCacheManager.allocate(id, length, length + 1)` takes from the pool)."""
    total = -(-(length + 1) // block_size)
    first = [max(length - w + 1, 0) // block_size if w else 0 for w in windows]
    return sum(total - f for f in first)


def build_engine(model: str, lens: list[int], source_len: int, block_size: int = 16,
                 dtype: str = "auto") -> Any:
    """An `LLMEngine` as `kvrelay serve` builds one, with serve's defaults but these: its
    max_model_len covers the longest sequence, its KV pool exactly the sequences held at
    once (every length, the tile source, the null block), max_num_seqs 1 (the greedy head
    warmed for one row only: a c=1 step's)."""
    from kvrelay.config import EngineArgs, EngineConfig
    from kvrelay.engine.core import LLMEngine

    max_len = max(max(lens) + 1, source_len)
    config = EngineConfig.from_args(EngineArgs(model=model, dtype=dtype, block_size=block_size,
                                               max_model_len=max_len, max_num_seqs=1))
    windows = _group_windows(config)
    blocks = sum(blocks_needed(n, block_size, windows) for n in lens)
    blocks += len(windows) * -(-source_len // block_size) + 1
    blocks = max(blocks, config.blocks_per_sequence)
    args = dataclasses.replace(config.args, num_gpu_blocks_override=blocks)
    return LLMEngine(dataclasses.replace(config, args=args))


def _group_windows(config: Any) -> list[int | None]:
    """Each KV-cache group's window as the engine will form them (`executor.kv_groups`)."""
    from kvrelay.model.gpt_oss import kv_cache_groups

    c = config.model
    groups = kv_cache_groups(c, not config.args.disable_hybrid_kv_cache_manager)
    windows: list[int | None] = []
    for g in range(max(groups) + 1):
        found = {c.window_of(i) for i, x in enumerate(groups) if x == g}
        windows.append(found.pop() if len(found) == 1 else None)
    return windows


def place(engine: Any, request_id: str, length: int) -> SyntheticSequence:
    """A sequence at context `length`: its blocks allocated as the scheduler allocates a
    decode at position `length` (sliding-window blocks out of reach already released)."""
    if not engine.kv.allocate(request_id, length, length + 1):
        raise RuntimeError(f"KV pool too small for a sequence of {length} tokens")
    return SyntheticSequence(request_id, length)


def step_input(engine: Any, seq: SyntheticSequence, token: int, greedy: bool = True) -> Any:
    """The decode step of `seq` at position L, as `step_io.step_input` builds it for a
    scheduled decode (one chunk of one token, its sampling row)."""
    from kvrelay.engine.runner import StepInput

    tables = engine.kv.block_ids(seq.request_id)
    return StepInput([token], [1], [seq.length], [[t] for t in tables], [0], num_decodes=1,
                     greedy=greedy)


def pick(out: torch.Tensor) -> int:
    """The greedy token of a one-row step: the LM head's own (greedy steps) or the
    sampler's argmax of the logits."""
    from kvrelay.engine.sampler import greedy_tokens

    return int(out[0]) if out.dim() == 1 else greedy_tokens(out)[0]


def decode_step(engine: Any, seq: SyntheticSequence, token: int) -> int:
    """One greedy decode step of `seq` at position L; returns its token."""
    return pick(engine.executor.execute(step_input(engine, seq, token)))


def prefill(engine: Any, request_id: str, tokens: list[int]) -> int:
    """A real prefill of `tokens` (one chunk from position 0) into fresh blocks of
    `request_id`, through the engine's runner; returns the greedy next token."""
    from kvrelay.engine.runner import StepInput

    n = len(tokens)
    if not engine.kv.allocate(request_id, 0, n):
        raise RuntimeError(f"KV pool too small for a prefill of {n} tokens")
    tables = engine.kv.block_ids(request_id)
    step = StepInput(list(tokens), [n], [0], [[t] for t in tables], [n - 1], greedy=True)
    return pick(engine.executor.execute(step))


# -- K/V fill ------------------------------------------------------------------------------------
def _targets(engine: Any, seq: SyntheticSequence) -> list[tuple[int, int]]:
    """(group, logical block) of every block of `seq` holding positions < L (null blocks
    of released sliding-window positions left out)."""
    B = engine.kv.block_size
    out = []
    for g, table in enumerate(engine.kv.block_ids(seq.request_id)):
        out += [(g, i) for i, b in enumerate(table) if b != 0 and i * B < seq.length]
    return out


def copy_blocks(engine: Any, src: list[int], dst: list[int]) -> None:
    """K and V of blocks `src` into blocks `dst` in every KV tensor (a block id belongs
    to one group, so each tensor's copy is that group's layer's K/V)."""
    if not dst:
        return
    s, d = torch.tensor(src), torch.tensor(dst)
    for kv in engine.runner.kv_tensors:                  # [2, num_blocks, kvh, B, hd]
        kv[:, d] = kv[:, s]


def tile_from(engine: Any, source_tables: list[list[int]], source_len: int) -> Filler:
    """A filler copying a source sequence's blocks (`source_len` tokens in
    `source_tables`, per group): block i from source block i where the source has it,
    else from i mod (its full blocks)."""
    B = engine.kv.block_size
    have, full = -(-source_len // B), source_len // B

    def fill(engine: Any, seq: SyntheticSequence) -> None:
        if seq.length > source_len and full == 0:
            raise ValueError(f"a tile source of {source_len} tokens has no full block of {B}")
        targets = _targets(engine, seq)
        tables = engine.kv.block_ids(seq.request_id)
        src = [source_tables[g][i if i < have else i % full] for g, i in targets]
        copy_blocks(engine, src, [tables[g][i] for g, i in targets])
    return fill


def random_fill(std: float, seed: int = 0) -> Filler:
    """A filler writing N(0, std) K/V into every block of the sequence."""
    generator = torch.Generator().manual_seed(seed)

    def fill(engine: Any, seq: SyntheticSequence) -> None:
        tables = engine.kv.block_ids(seq.request_id)
        ids = torch.tensor([tables[g][i] for g, i in _targets(engine, seq)])
        for kv in engine.runner.kv_tensors:              # [2, num_blocks, kvh, B, hd]
            values = torch.randn((2, len(ids), *kv.shape[2:]), generator=generator)
            kv[:, ids] = (values * std).to(kv.dtype)
    return fill


# -- bytes per step -------------------------------------------------------------------------------
def kv_bytes_read(model: Any, length: int) -> int:
    """K/V bytes one decode step at position `length` reads over all layers."""
    c = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    per_key = 2 * model.num_kv_heads_local * c.head_dim * elem          # K and V of one token
    keys = 0
    for i in range(c.num_hidden_layers):
        window = c.window_of(i)
        keys += min(length + 1, window) if window else length + 1
    return keys * per_key


def weight_bytes_read(model: Any) -> int:
    """Weight bytes a one-token step reads: the resident weights less the experts not
    routed to (top-k of E per layer) and all embedding rows but one."""
    c = model.config
    experts = sum(layer.mlp.experts.nbytes() for layer in model.layers)
    embedding = model.embed_tokens.weight.nbytes
    unused = experts * (1 - c.num_experts_per_tok / c.num_local_experts)
    return int(model.weight_bytes() - unused - embedding * (1 - 1 / c.vocab_size))


def decode_path(engine: Any) -> str:
    """Which path the last c=1 decode step took: "stack" (every layer in one native call),
    "fused" (the layers' fused ops) or "layers" (the separate ops)."""
    model = engine.model
    if not model.plan.fused_decode:
        return "layers"
    stack = model._stack                       # read only: made by the model's first decode
    if stack is not None and any(ok for (rows, _), ok in stack.usable.items() if rows == 1):
        return "stack"
    return "fused"


# -- measurement ----------------------------------------------------------------------------------
def time_steps(engine: Any, seq: SyntheticSequence, token: int,
               steps: int) -> tuple[list[float], int]:
    """`steps` decode steps of `seq` at position L, each fed the previous one's token:
    (ms per step, the last token). Timed: the executor's step (input preparation,
    forward, LM head) and the greedy pick."""
    step = step_input(engine, seq, token)
    times = []
    for _ in range(steps):
        step.token_ids[0] = token
        t0 = time.perf_counter()
        token = pick(engine.executor.execute(step))
        times.append((time.perf_counter() - t0) * 1e3)
    return times, token


def run(engine: Any, lens: list[int], steps: int, warmup: int, rounds: int,
        fill: Filler, token: int) -> list[dict[str, Any]]:
    """Every length's sequence placed and filled, then `rounds` rounds of `steps` timed
    steps per length (after `warmup` untimed ones each round); one row per length."""
    seqs: list[SyntheticSequence] = []
    times: dict[int, list[float]] = {n: [] for n in lens}
    tokens = dict.fromkeys(lens, token)
    try:
        for n in lens:
            t0 = time.perf_counter()
            seqs.append(place(engine, f"long-context-{n}", n))
            fill(engine, seqs[-1])
            log(f"context {n}: K/V placed in {time.perf_counter() - t0:.1f} s")
        for r in range(rounds):
            for seq in seqs:
                _, t = time_steps(engine, seq, tokens[seq.length], warmup)
                ms, tokens[seq.length] = time_steps(engine, seq, t, steps)
                times[seq.length] += ms
                log(f"round {r + 1}/{rounds} context {seq.length}: "
                    f"median {statistics.median(ms):.2f} ms/step")
    finally:
        for seq in seqs:
            engine.kv.free(seq.request_id)
    return rows(engine.model, lens, times)


def rows(model: Any, lens: list[int], times: dict[int, list[float]]) -> list[dict[str, Any]]:
    weights = weight_bytes_read(model)
    base = 1e3 / statistics.median(times[min(lens)])
    out = []
    for n in lens:
        ms = sorted(times[n])
        median = statistics.median(ms)
        kv = kv_bytes_read(model, n)
        out.append({"context": n, "steps": len(ms), "median_ms": round(median, 3),
                    "p10_ms": round(ms[len(ms) // 10], 3),
                    "p90_ms": round(ms[-1 - len(ms) // 10], 3),
                    "tok_s": round(1e3 / median, 3),
                    "ratio_to_shortest": round(1e3 / median / base, 4),
                    "kv_bytes_read": kv, "weight_bytes_read": weights,
                    "kv_share_of_bytes": round(kv / (kv + weights), 4)})
    return out


def target(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue-28 check: tok/s at the longest context ÷ tok/s at the shortest."""
    short = min(table, key=lambda r: r["context"])
    long = max(table, key=lambda r: r["context"])
    ratio = long["tok_s"] / short["tok_s"]
    return {"short": short["context"], "long": long["context"], "ratio": round(ratio, 4),
            "threshold": TARGET_RATIO, "met": ratio >= TARGET_RATIO}


def print_table(table: list[dict[str, Any]], check: dict[str, Any]) -> None:
    print(f"{'context':>8} {'median ms':>10} {'p10':>8} {'p90':>8} {'tok/s':>8} "
          f"{'ratio':>6} {'KV MiB/step':>11} {'weights MiB':>11} {'KV share':>8}")
    for r in table:
        print(f"{r['context']:>8} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} "
              f"{r['p90_ms']:>8.2f} {r['tok_s']:>8.2f} {r['ratio_to_shortest']:>6.3f} "
              f"{r['kv_bytes_read'] / 2**20:>11.2f} {r['weight_bytes_read'] / 2**20:>11.1f} "
              f"{r['kv_share_of_bytes']:>8.3f}")
    print(f"target: tok/s at {check['long']} / at {check['short']} = {check['ratio']:.3f} "
          f"(≥ {check['threshold']}: {'met' if check['met'] else 'NOT met'})")


def make_filler(engine: Any, kind: str, source_len: int, kv_std: float) -> tuple[Filler, int]:
    """The K/V filler and the first token to feed: a real prefill of `source_len` random
    tokens (`tile`; its greedy token) or random values (`random`; token 0)."""
    if kind == "random":
        return random_fill(kv_std), 0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.model_config.vocab_size, (source_len,), generator=g).tolist()
    t0 = time.perf_counter()
    token = prefill(engine, SOURCE_ID, prompt)
    log(f"tile source: a {source_len}-token prefill in {time.perf_counter() - t0:.1f} s")
    return tile_from(engine, engine.kv.block_ids(SOURCE_ID), source_len), token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the benchmarks' tiny config)")
    ap.add_argument("--lens", default=",".join(map(str, DEFAULT_LENS)),
                    help="context lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per length and round")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=1, help="the lengths timed in turn R times")
    ap.add_argument("--threads", type=int, help="intra-op threads (default: torch's, as serve)")
    ap.add_argument("--fill", choices=("tile", "random"), default="tile")
    ap.add_argument("--source-len", type=int, default=256, help="tokens of the tile source")
    ap.add_argument("--kv-std", type=float, default=1.0, help="--fill random: the values' std")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    a = ap.parse_args()
    lens = sorted({int(x) for x in a.lens.split(",") if x.strip()})
    if not lens or lens[0] < 1 or a.steps < 1 or a.source_len < 1:
        ap.error("--lens, --steps and --source-len must be positive")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model or str(build_checkpoint("tiny", CONFIGS["tiny"]))
    t0 = time.perf_counter()
    log(f"loading {model} ...")
    engine = build_engine(model, lens, a.source_len)
    log(f"engine ready in {time.perf_counter() - t0:.1f} s")
    try:
        fill, token = make_filler(engine, a.fill, a.source_len, a.kv_std)
        table = run(engine, lens, a.steps, a.warmup, a.rounds, fill, token)
        path = decode_path(engine)
    finally:
        engine.kv.free(SOURCE_ID)
        engine.shutdown()
    from kvrelay.model.fast_paths import native_paths

    check = target(table)
    result = {"model": model, "config": engine.model_config.raw, "dtype": str(engine.model.dtype),
              "block_size": engine.kv.block_size, "threads": engine.runner.max_threads,
              "plan": engine.model.plan.describe(), "native_paths": native_paths(),
              "decode_path": path, "fill": a.fill, "source_len": a.source_len,
              "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
              "weight_bytes": engine.model.weight_bytes(), "rows": table, "target": check,
              "cpu": cpu_model(), "git": git_sha(), "torch": torch.__version__,
              "load_after": os.getloadavg()}
    print_table(table, check)
    print(f"decode path: {path}; threads {result['threads']}; plan: {result['plan']}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
