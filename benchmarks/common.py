"""Shared helpers for the throughput benchmarks (offline_throughput.py, serve_throughput.py).

Only the standard library, torch and transformers are imported at module level, so the
vLLM venv (which has no kvrelay) can import this file too.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVRELAY_BENCH_CACHE", Path(tempfile.gettempdir()) / "kvrelay-bench"))
# Where the peers are installed: PEERS_DIR/vllm (setup_vllm_cpu.sh's venv) and
# PEERS_DIR/llamacpp (build_llamacpp.sh's tree). Default: `peers/` beside this checkout.
PEERS_DIR = Path(os.environ.get("KVRELAY_PEERS_DIR", ROOT.parent / "peers"))
# The scripts that build the peers (setup_vllm_cpu.sh, build_llamacpp.sh, convert_gguf.py).
# Default: `shared/peers/` beside this checkout, where the team keeps them.
PEER_SCRIPTS = Path(os.environ.get("KVRELAY_PEER_SCRIPTS", ROOT.parent / "shared" / "peers"))
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(PEERS_DIR / "vllm" / "bin" / "python"))
THREADS = int(os.environ.get("BENCH_THREADS", "2"))

# -- model configurations ------------------------------------------------------------------
# Both are gpt-oss-shaped (alternating sliding/full attention, sinks, YaRN, MoE with
# clamped SwiGLU and biases) and written as bf16 checkpoints.
#   tiny: overhead-bound, every matmul is small; the step's Python/dispatch cost dominates.
#   big:  compute-bound at batch 64 (hidden 1024, 32 experts top-4, vocab 32000).
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=128, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                 num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
                 max_position_embeddings=4096),
    "big": dict(vocab_size=32000, hidden_size=1024, intermediate_size=1024, head_dim=64,
                num_attention_heads=16, num_key_value_heads=2, num_hidden_layers=8,
                num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                max_position_embeddings=4096),
}
# --quick: the same shapes at a fraction of the cost (a smoke run, not a measurement)
QUICK_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": CONFIGS["tiny"] | dict(num_hidden_layers=2),
    "big": CONFIGS["big"] | dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                 num_local_experts=8, vocab_size=4096),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_result(result: dict[str, Any], out: Path | None) -> None:
    """Print a benchmark's JSON result (with the load average after it) and write it to
    `out` if given."""
    result["load_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text)
    log("done")


def config_key(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]


def build_checkpoint(name: str, cfg: dict[str, Any], seed: int = 0) -> Path:
    """A random gpt-oss checkpoint in bf16 with a word-level tokenizer ("w0" … "wN").

    Weights use transformers' own init (std 0.02), except routers (std 1, so expert
    choice is spread) and sinks; cached under $KVRELAY_BENCH_CACHE keyed by the config."""
    import torch
    path = CACHE / f"{name}-{config_key(cfg)}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    from transformers import GptOssConfig, GptOssForCausalLM
    log(f"checkpoint {name}: building {path} ...")
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".tmp")
    config = GptOssConfig(**cfg, dtype="bfloat16")
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "router.weight" in pname:
                p.normal_(0.0, 1.0 / cfg["hidden_size"] ** 0.5 * 4)
            elif "sinks" in pname:
                p.normal_(0.0, 1.0)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.02)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp)
    _word_tokenizer(tmp, cfg["vocab_size"])
    tmp.rename(path)
    log(f"checkpoint {name}: done in {time.perf_counter() - t0:.0f} s")
    return path


def _word_tokenizer(path: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over "w0" … "w{V-1}" (whitespace split, decode joins with
    spaces): every id round-trips, so text-based clients (vllm bench serve) keep their
    token counts. No EOS is used (the benchmarks pass ignore_eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    eos = vocab_size - 1
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"w{eos}",
        "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    cfgp = path / "config.json"
    raw = json.loads(cfgp.read_text())
    raw["eos_token_id"], raw["pad_token_id"] = eos, 0
    cfgp.write_text(json.dumps(raw, indent=2))


# -- workload -----------------------------------------------------------------------------
def make_workload(num: int, in_range: tuple[int, int], out_range: tuple[int, int],
                  vocab: int, seed: int) -> dict[str, Any]:
    """nano-vllm's shape: random prompt token ids and random output lengths."""
    rng = random.Random(seed)
    lo = 1  # keep 0 (pad) out of prompts
    prompts = [[rng.randrange(lo, vocab) for _ in range(rng.randint(*in_range))]
               for _ in range(num)]
    outs = [rng.randint(*out_range) for _ in range(num)]
    return {"prompts": prompts, "output_lens": outs, "seed": seed,
            "input_range": list(in_range), "output_range": list(out_range)}


# -- machine --------------------------------------------------------------------------------
def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def others_busy_cores(seconds: float = 5.0) -> float:
    """Cores kept busy by processes that are not ours (nothing of ours runs meanwhile)."""
    b0, t0 = cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = cpu_jiffies()
    return (os.cpu_count() or 1) * (b1 - b0) / max(t1 - t0, 1)


def wait_for_quiet(max_wait_s: float, max_busy: float = 0.75) -> dict[str, float]:
    """Waits (up to max_wait_s) until other processes keep at most `max_busy` cores busy;
    measurements go ahead anyway, with what was seen recorded."""
    t0 = time.monotonic()
    busy = others_busy_cores()
    while busy > max_busy and time.monotonic() - t0 < max_wait_s:
        log(f"other processes keep {busy:.2f} cores busy (load {loadavg():.2f}); waiting 30 s")
        time.sleep(30)
        busy = others_busy_cores()
    return {"others_busy_cores_before": round(busy, 2), "loadavg_before": loadavg(),
            "waited_s": round(time.monotonic() - t0, 1)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvrelay"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def vllm_version() -> str | None:
    if not Path(VLLM_PYTHON).exists():
        return None
    r = subprocess.run([VLLM_PYTHON, "-c",
                        "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    import torch
    import transformers
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "vllm_cpu": vllm_version(),
        "kvrelay_git": git_sha(), "threads": THREADS,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def measure_limits(quick: bool = False) -> dict[str, Any]:
    """Matmul FLOP/s (fp32, bf16) at n³ and n×n×n shapes, and copy bandwidth, with torch
    on THREADS threads. bf16 is measured in the layouts a linear layer uses
    (x @ Wᵀ, as F.linear) and the plain one (x @ W, as transformers' experts)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(THREADS)

    def best(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    out: dict[str, Any] = {"threads": THREADS}
    n = 1024 if quick else 2048
    for dt, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        # a @ bᵀ
        out[f"{label}_linear_{n}_gflops"] = 2 * n**3 / best(partial(F.linear, a, b), 3) / 1e9
        # a @ b (transformers' experts use x @ W[in, out]); in bf16 without native bf16 this
        # path runs at ~0.1-1 GFLOP/s, so it is timed once at n/2
        m = n if dt == torch.float32 else n // 2
        a2, b2 = a[:m, :m].contiguous(), b[:m, :m].contiguous()
        reps = 3 if m == n else 1
        out[f"{label}_matmul_{m}_gflops"] = 2 * m**3 / best(partial(torch.matmul, a2, b2),
                                                            reps) / 1e9
        # a decode-shaped linear: batch 64 through a 1024 -> 2048 weight
        x, w = torch.randn(64, 1024, dtype=dt), torch.randn(2048, 1024, dtype=dt)
        out[f"{label}_linear_64x1024x2048_gflops"] = (2 * 64 * 1024 * 2048
                                                      / best(partial(F.linear, x, w), 10) / 1e9)
    size = (256 if quick else 1024) * 2**20
    src = torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = best(lambda: dst.copy_(src), 5)
    out["copy_bandwidth_gbs"] = 2 * size / t / 1e9          # read + write
    out["copy_bytes"] = size
    out["fp32_peak_gflops"] = max(v for k, v in out.items() if k.startswith("fp32_")
                                  and k.endswith("gflops"))
    out["bf16_peak_gflops"] = max(v for k, v in out.items() if k.startswith("bf16_")
                                  and k.endswith("gflops"))
    return out
