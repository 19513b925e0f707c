"""Write a gpt-oss-20b-shaped checkpoint with random weights in the official MXFP4 layout.

    python benchmarks/make_gpt_oss_20b.py OUT_DIR [--layers N] [--seed S]

The config is gpt-oss-20b's published one (24 layers, 32 experts top-4, hidden and
intermediate 2880, 64 query / 8 KV heads of 64, sliding window 128 on alternate layers,
o200k vocabulary padded to 201088, YaRN rope, `quantization_config` as published). The
experts are `model.layers.N.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}` uint8
plus bf16 biases; every other tensor is bf16 — the same names, shapes and dtypes as the
published safetensors, ~13 GB. The tokenizer is the o200k `tokenizer.json` with harmony's
special tokens, built offline (see tests/harmony_factories.py).

Memory stays bounded: one shard (one decoder layer, or the embedding, or the LM head) is
generated, written and freed at a time. Random values are scaled so a forward stays finite:
bf16 weights ~ N(0, 0.02); MXFP4 codes uniform over the 16 e2m1 values with scales 2^-7 or
2^-8 (dequantised rms ≈ 0.02); routers std 4/sqrt(hidden) so the expert choice is spread.

`--layers N` writes the same shapes with N layers (a smaller checkpoint for tests/smoke runs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]

HIDDEN, INTER, EXPERTS, HEADS, KV_HEADS, HEAD_DIM = 2880, 2880, 32, 64, 8, 64
VOCAB, LAYERS, BLOCK = 201088, 24, 32


def gpt_oss_20b_config(num_layers: int = LAYERS) -> dict:
    """gpt-oss-20b's published config.json (layer_types follow the layer count)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(num_layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": HEADS,
        "num_experts_per_tok": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": EXPERTS,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


GENERATION_CONFIG = {"bos_token_id": 199998, "do_sample": True,
                     "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999,
                     "transformers_version": "4.55.0.dev0"}


class Rand:
    """Seeded random tensors, generated in chunks so no float32 copy of a big tensor exists."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.np = np.random.default_rng(seed)

    def normal(self, shape: tuple[int, ...], std: float) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16)
        flat = out.view(-1)
        chunk = 1 << 24
        for i in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - i)
            flat[i:i + n] = torch.randn(n, generator=self.gen).mul_(std)
        return out

    def bytes(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(np.prod(shape))
        return torch.frombuffer(bytearray(self.np.bytes(n)), dtype=torch.uint8).view(shape)

    def scales(self, shape: tuple[int, ...]) -> torch.Tensor:
        # e8m0 exponents 120/119 (2^-7, 2^-8): e2m1 codes (rms 2.9) land at rms ~0.017
        return torch.from_numpy(self.np.integers(119, 121, size=shape, dtype=np.uint8))


def layer_tensors(i: int, r: Rand) -> dict[str, torch.Tensor]:
    p, x = f"model.layers.{i}", f"model.layers.{i}.mlp.experts"
    q, kv, g = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HIDDEN // BLOCK
    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return {
        f"{p}.input_layernorm.weight": ones.clone(),
        f"{p}.post_attention_layernorm.weight": ones.clone(),
        f"{p}.self_attn.q_proj.weight": r.normal((q, HIDDEN), 0.02),
        f"{p}.self_attn.q_proj.bias": r.normal((q,), 0.02),
        f"{p}.self_attn.k_proj.weight": r.normal((kv, HIDDEN), 0.02),
        f"{p}.self_attn.k_proj.bias": r.normal((kv,), 0.02),
        f"{p}.self_attn.v_proj.weight": r.normal((kv, HIDDEN), 0.02),
        f"{p}.self_attn.v_proj.bias": r.normal((kv,), 0.02),
        f"{p}.self_attn.o_proj.weight": r.normal((HIDDEN, q), 0.02),
        f"{p}.self_attn.o_proj.bias": r.normal((HIDDEN,), 0.02),
        f"{p}.self_attn.sinks": r.normal((HEADS,), 1.0),
        f"{p}.mlp.router.weight": r.normal((EXPERTS, HIDDEN), 4.0 / HIDDEN ** 0.5),
        f"{p}.mlp.router.bias": r.normal((EXPERTS,), 0.02),
        f"{x}.gate_up_proj_blocks": r.bytes((EXPERTS, 2 * INTER, g, BLOCK // 2)),
        f"{x}.gate_up_proj_scales": r.scales((EXPERTS, 2 * INTER, g)),
        f"{x}.gate_up_proj_bias": r.normal((EXPERTS, 2 * INTER), 0.02),
        f"{x}.down_proj_blocks": r.bytes((EXPERTS, HIDDEN, INTER // BLOCK, BLOCK // 2)),
        f"{x}.down_proj_scales": r.scales((EXPERTS, HIDDEN, INTER // BLOCK)),
        f"{x}.down_proj_bias": r.normal((EXPERTS, HIDDEN), 0.02),
    }


def shard_plan(num_layers: int) -> list[tuple[str, object]]:
    """(kind, arg) per shard: the embedding, one shard per layer, then norm + LM head."""
    return [("embed", None)] + [("layer", i) for i in range(num_layers)] + [("head", None)]


def shard_tensors(kind: str, arg: object, r: Rand) -> dict[str, torch.Tensor]:
    if kind == "embed":
        return {"model.embed_tokens.weight": r.normal((VOCAB, HIDDEN), 0.02)}
    if kind == "layer":
        return layer_tensors(int(arg), r)  # type: ignore[arg-type]
    return {"model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            "lm_head.weight": r.normal((VOCAB, HIDDEN), 0.02)}


def write_tokenizer(out: Path) -> None:
    sys.path.insert(0, str(REPO))
    from tests.harmony_factories import make_o200k_tokenizer_json
    make_o200k_tokenizer_json(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "model_max_length": 131072}, indent=2))


def write_checkpoint(out: Path, num_layers: int, seed: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(num_layers)
    r = Rand(seed)
    weight_map: dict[str, str] = {}
    total, t0 = 0, time.perf_counter()
    for k, (kind, arg) in enumerate(plan):
        name = f"model-{k:05d}-of-{len(plan) - 1:05d}.safetensors"
        tensors = shard_tensors(kind, arg, r)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
        print(f"[{time.perf_counter() - t0:6.0f} s] shard {k + 1}/{len(plan)} {name}: "
              f"{nbytes / 2**20:.0f} MiB (total {total / 2**30:.2f} GiB)", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    need = (2 * VOCAB * HIDDEN * 2 + args.layers * 570_000_000) * 1.05
    free = shutil.disk_usage(args.out.parent if not args.out.exists() else args.out).free
    if free < need:
        sys.exit(f"{args.out}: needs ~{need / 2**30:.1f} GiB free, {free / 2**30:.1f} GiB left")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(gpt_oss_20b_config(args.layers), indent=2))
    (args.out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    write_tokenizer(args.out)
    total = write_checkpoint(args.out, args.layers, args.seed)
    print(f"{args.out}: {total / 1e9:.2f} GB of tensors", flush=True)


if __name__ == "__main__":
    main()
