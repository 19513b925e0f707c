"""Tiny gpt-oss checkpoints made by the tests themselves (transformers as reference)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvrelay.model import mxfp4

TINY: dict[str, Any] = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, head_dim=16,
    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    max_position_embeddings=512,
)


def make_hf_model(seed: int = 0, **overrides: Any):
    """A random transformers GptOssForCausalLM (float32) with peaked logits."""
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(**(TINY | overrides))
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        # larger random weights than the init's std 0.02 make the logits peaked, so
        # greedy comparisons rarely hit near-ties, and make experts/sinks matter
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            std = 1.0 if ("sinks" in name or "router" in name) else 0.08
            p.normal_(0.0, std)
    return model


def save_checkpoint(model, path: Path, mxfp4_experts: bool = False) -> Path:
    """save_pretrained, optionally rewriting the experts in the official MXFP4 layout."""
    model.save_pretrained(path)
    if not mxfp4_experts:
        return path
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = tensors.pop(name)                                   # [E, in, out]
        blocks, scales = mxfp4.quantize(w.transpose(1, 2))  # [E, out, in/32, 16], [E, out, in/32]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' eager float32 logits for one sequence → [len, V]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def dequantized_reference(path: Path):
    """Load an MXFP4 checkpoint into transformers, dequantised (the brief's recipe)."""
    from transformers import GptOssForCausalLM, Mxfp4Config
    return GptOssForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()


def add_word_tokenizer(path: Path, vocab_size: int, eos_id: int | None = None) -> Path:
    """A word-level tokenizer.json ("w0" … "wN", space separated) for a tiny checkpoint,
    so engine tests can use text prompts and stop strings."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    if eos_id is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                "{% if add_generation_prompt %}w4{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


def greedy_mismatch(hf_model, prompt: list[int], generated: list[int],
                    eps: float = 1e-4) -> str | None:
    """The brief's near-tie rule: `generated` must equal the reference's greedy choice at
    every position up to the first one where the reference's top-2 logit gap is below
    eps (after which the sequences may diverge). Returns a description of the first
    real mismatch, or None. Teacher-forced: one reference forward over prompt+generated."""
    logits = reference_logits(hf_model, prompt + generated)[len(prompt) - 1:]
    for j, token in enumerate(generated):
        top2 = logits[j].topk(2)
        gap = float(top2.values[0] - top2.values[1])
        if gap < eps:
            return None
        if token != int(top2.indices[0]):
            return f"position {j}: got {token}, reference {int(top2.indices[0])} (gap {gap:.2e})"
    return None
