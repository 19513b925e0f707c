"""Communication volume per token for the tutorial's gpt-oss topologies, from the config.

    python benchmarks/comm_volume.py            # prints the markdown tables in docs/parallelism.md

Counts payload bytes (bf16 activations, fp32 logits), not wire overheads. Ring
all-reduce moves 2·(N-1)/N of the payload per rank; all-gather (N-1)/N.
"""
from __future__ import annotations

from dataclasses import dataclass

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    vocab: int = 201088
    window: int = 128


GPT_OSS = [Model("gpt-oss-120b", 36, 2880, 64, 8, 64, 128, 4),
           Model("gpt-oss-20b", 24, 2880, 64, 8, 64, 32, 4)]


def ring(n: int, payload: float, factor: float = 2.0) -> float:
    return 0 if n == 1 else factor * (n - 1) / n * payload


def per_token(m: Model, tp: int, ep: int, moe: str) -> dict[str, float]:
    act = m.hidden * BF16
    attn = m.layers * ring(tp, act)                                   # o_proj all-reduce
    if moe == "all-to-all":     # dispatch + combine of each token's top-k hidden states
        moe_bytes = m.layers * 2 * m.top_k * act * (ep - 1) / ep
    else:                       # expert shards summed with an all-reduce over the TP group
        moe_bytes = m.layers * ring(tp, act)
    embed = ring(tp, act)                                             # vocab-parallel embedding
    logits = ring(tp, m.vocab * FP32, factor=1.0)                     # LM-head all-gather
    return {"attention all-reduce": attn, "MoE": moe_bytes, "embedding": embed,
            "logits all-gather": logits}


def kv_bytes(m: Model, prompt: int) -> float:
    per_layer_token = 2 * m.kv_heads * m.head_dim * BF16
    full, sliding = m.layers // 2, m.layers - m.layers // 2
    return per_layer_token * (full * prompt + sliding * min(prompt, m.window))


def main() -> None:
    layouts = [("decode TP8 DP8 EP64 (120b)", GPT_OSS[0], 8, 64, "all-to-all"),
               ("decode TP8 DP4 EP32 (20b)", GPT_OSS[1], 8, 32, "all-to-all"),
               ("prefill TP4, ep_degree 2", GPT_OSS[0], 4, 2, "all-reduce")]
    print("| layout | attention all-reduce | MoE | embedding | logits all-gather "
          "| total per token |")
    print("|---|---|---|---|---|---|")
    for name, m, tp, ep, moe in layouts:
        v = per_token(m, tp, ep, moe)
        cells = " | ".join(f"{x / 1024:.1f} KiB" for x in v.values())
        print(f"| {name} | {cells} | {sum(v.values()) / 1024:.1f} KiB |")
    print()
    print("| model | prompt tokens | KV bytes moved prefill → decode (hybrid: sliding layers send "
          "≤ 128 tokens) | without the window rule |")
    print("|---|---|---|---|")
    for m in GPT_OSS:
        for p in (1024, 8192, 16384):
            flat = 2 * m.kv_heads * m.head_dim * BF16 * m.layers * p
            print(f"| {m.name} | {p} | {kv_bytes(m, p) / 2**20:.1f} MiB | {flat / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
