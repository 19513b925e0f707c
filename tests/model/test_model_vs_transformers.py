"""kvrelay's gpt-oss logits against transformers' eager float32 reference."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.model.config import CheckpointError
from kvrelay.model.generate import PagedGreedyLoop, _Seq
from kvrelay.model.loader import load_model
from tests.factories import dequantized_reference, make_hf_model, reference_logits, save_checkpoint

PROMPT_LEN = 40  # longer than every sliding window below except the "window > prompt" case

YARN = None  # transformers' gpt-oss default: YaRN factor 32
PLAIN = {"rope_type": "default", "rope_theta": 10000.0}

CONFIGS = {
    # name: (config overrides, experts on disk)
    "gqa1-yarn-top2": (dict(num_key_value_heads=4, rope_parameters=YARN), "dense"),
    "gqa2-plain-top1": (dict(num_key_value_heads=2, rope_parameters=PLAIN, num_experts_per_tok=1),
                        "dense"),
    "gqa4-yarn-top4": (dict(num_key_value_heads=1, num_experts_per_tok=4), "dense"),
    "window-gt-prompt": (dict(sliding_window=64, num_hidden_layers=3), "dense"),
    "mxfp4-top4": (dict(num_experts_per_tok=4, num_hidden_layers=3), "mxfp4"),
    "mxfp4-gqa2-plain": (dict(rope_parameters=PLAIN, sliding_window=5), "mxfp4"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    overrides, experts = CONFIGS[request.param]
    overrides = {k: v for k, v in overrides.items() if v is not None or k != "rope_parameters"}
    hf = make_hf_model(seed=len(request.param), **overrides)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param),
                           mxfp4_experts=experts == "mxfp4")
    reference = dequantized_reference(path) if experts == "mxfp4" else hf
    return path, reference, experts


def _prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_transposed_expert_weight_is_refused(checkpoint, tmp_path):
    # every config here has hidden_size != intermediate_size, so a transposed expert
    # weight (dense, or MXFP4 blocks) cannot load: the comparisons below see real layouts
    path, _, _ = checkpoint
    copy = shutil.copytree(path, tmp_path / "ckpt")
    tensors = load_file(str(copy / "model.safetensors"))
    name = next(n for n in sorted(tensors)
                if n.endswith(("gate_up_proj", "gate_up_proj_blocks")))
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} has shape"):
        load_model(copy, progress=False)


def test_prefill_logits_match_transformers(checkpoint):
    path, reference, experts = checkpoint
    loaded = load_model(path, dtype=torch.float32, progress=False)
    assert loaded.mxfp4_on_disk == (experts == "mxfp4")
    prompt = _prompt(reference.config.vocab_size)
    ref = reference_logits(reference, prompt)
    ours = PagedGreedyLoop(loaded.model, 64, 4).step([_Seq(prompt)], [len(prompt)])
    assert (ours - ref).abs().max().item() < 1e-4


def test_incremental_paged_decoding_equals_full_forward(checkpoint):
    """Prompt in uneven chunks, then one token at a time; block size 4 (< window) and
    shuffled, non-contiguous blocks."""
    path, reference, _ = checkpoint
    model = load_model(path, dtype=torch.float32, progress=False).model
    prompt = _prompt(reference.config.vocab_size, seed=2)
    full = reference_logits(reference, prompt)
    loop = PagedGreedyLoop(model, 64, 4, shuffle_blocks=True, seed=3)
    seq, got = _Seq(prompt), []
    for n in [9, 3, 13, 1, 1, 5] + [1] * (len(prompt) - 32):
        got.append(loop.step([seq], [n]))
    assert (torch.cat(got) - full).abs().max().item() < 1e-4


def test_mixed_batch_of_decodes_and_prefills(checkpoint):
    """Sequences at different stages share one step: decodes first, then chunks."""
    path, reference, _ = checkpoint
    model = load_model(path, dtype=torch.float32, progress=False).model
    prompts = [_prompt(reference.config.vocab_size, n, seed=n) for n in (23, 11, 31)]
    loop = PagedGreedyLoop(model, 96, 4, shuffle_blocks=True)
    seqs = [_Seq(p) for p in prompts]
    loop.step(seqs[:2], [22, 10])                      # two prefills
    out = loop.step(seqs, [1, 1, 31])                  # two decodes + one whole prefill
    assert (out[0] - reference_logits(reference, prompts[0])[22]).abs().max() < 1e-4
    assert (out[1] - reference_logits(reference, prompts[1])[10]).abs().max() < 1e-4
    assert (out[2:] - reference_logits(reference, prompts[2])).abs().max() < 1e-4


def test_bfloat16_agrees_on_top_tokens(checkpoint):
    path, reference, _ = checkpoint
    model = load_model(path, dtype=torch.bfloat16, progress=False).model
    prompt = _prompt(reference.config.vocab_size, seed=4)
    ref = reference_logits(reference, prompt)
    ours = PagedGreedyLoop(model, 64, 4).step([_Seq(prompt)], [len(prompt)])
    gap = ref.topk(2).values
    clear = (gap[:, 0] - gap[:, 1]) > 0.1               # positions without a near-tie at bf16
    assert clear.sum() > len(prompt) // 2
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
