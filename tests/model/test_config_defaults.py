"""config.json keys a checkpoint leaves out are read exactly as transformers' GptOssConfig
reads them (the reference the brief's invariants compare against).

Each case starts from a full tiny config, drops or changes some keys, and compares every
field kvrelay derives with the transformers config built from the same dict; RoPE is
compared by its actual inverse frequencies and cos/sin scale, through transformers' own
RoPE init functions.
"""
from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

from kvrelay.model.config import CheckpointError, GptOssConfig, load_config
from kvrelay.model.layers.rotary import inverse_frequencies

FULL: dict[str, Any] = {
    "model_type": "gpt_oss", "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
    "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "swiglu_alpha": 1.5, "swiglu_limit": 5.0,
    "attention_bias": True, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                     "original_max_position_embeddings": 128, "truncate": False},
}
YARN_BARE = {"rope_type": "yarn", "factor": 8.0}

# name → (keys removed from FULL, keys set on top)
CASES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "full": ((), {}),
    "no-rope-scaling": (("rope_scaling",), {}),
    "no-rope-at-all": (("rope_scaling", "rope_theta"), {}),
    "rope-scaling-null": (("rope_scaling",), {"rope_scaling": None}),
    "rope-scaling-empty": (("rope_scaling",), {"rope_scaling": {}}),
    "yarn-bare": (("rope_scaling",), {"rope_scaling": YARN_BARE}),
    "yarn-bare-no-theta": (("rope_scaling", "rope_theta"), {"rope_scaling": YARN_BARE}),
    "yarn-old-type-key": (("rope_scaling",), {"rope_scaling": {"type": "yarn", "factor": 2.0}}),
    "yarn-null-betas": (("rope_scaling",), {"rope_scaling": YARN_BARE | {"beta_fast": None,
                                                                          "beta_slow": None}}),
    "yarn-attention-factor": (("rope_scaling",),
                              {"rope_scaling": YARN_BARE | {"attention_factor": 1.25}}),
    "scaling-without-type": (("rope_scaling",), {"rope_scaling": {"factor": 8.0}}),
    "plain-default-type": (("rope_scaling",), {"rope_scaling": {"rope_type": "default"}}),
    "rope-parameters": (("rope_scaling", "rope_theta"),
                        {"rope_parameters": {"rope_type": "default", "rope_theta": 777.0}}),
    "rope-parameters-and-top-theta": (("rope_scaling",), {"rope_parameters": YARN_BARE}),
    "scaling-wins-over-parameters": (("rope_scaling",), {
        "rope_scaling": YARN_BARE, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}),
    "no-head-dim": (("head_dim",), {}),
    "no-kv-heads": (("num_key_value_heads",), {"num_attention_heads": 16}),
    "no-experts": (("num_local_experts", "num_experts_per_tok"), {}),
    "num-experts-alias": (("num_local_experts",), {"num_experts": 8}),
    "openai-experts-per-token-ignored": (("num_experts_per_tok",), {"experts_per_token": 1}),
    "no-window-no-layer-types": (("sliding_window", "layer_types"), {}),
    "null-layer-types": ((), {"layer_types": None}),
    "no-swiglu": (("swiglu_limit", "swiglu_alpha"), {}),
    "no-eps-no-max-pos": (("rms_norm_eps", "max_position_embeddings"), {}),
    "no-max-pos-yarn-bare": (("max_position_embeddings", "rope_scaling"),
                             {"rope_scaling": YARN_BARE}),
    "initial-context-length-ignored": (("rope_scaling",), {"initial_context_length": 256,
                                                           "rope_scaling": YARN_BARE}),
    "no-attention-bias": (("attention_bias",), {}),
    "no-sizes": (("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "head_dim", "num_key_value_heads", "layer_types"), {}),
}


def _config_dict(name: str) -> dict[str, Any]:
    removed, added = CASES[name]
    cfg = {k: v for k, v in FULL.items() if k not in removed}
    return json.loads(json.dumps(cfg | added))       # as read from a file: no shared dicts


def _transformers_config(cfg: dict[str, Any]):
    from transformers import GptOssConfig as HfConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HfConfig(**json.loads(json.dumps(cfg)))


def _transformers_rope(hf) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
        return GptOssRotaryEmbedding.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")


@pytest.mark.parametrize("name", list(CASES))
def test_config_fields_equal_transformers(name):
    cfg = _config_dict(name)
    ours, hf = GptOssConfig.from_dict(cfg), _transformers_config(cfg)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                  "num_experts_per_tok", "sliding_window", "max_position_embeddings",
                  "rms_norm_eps", "swiglu_alpha", "swiglu_limit", "attention_bias"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert list(ours.layer_types) == list(hf.layer_types)
    params = hf.rope_parameters
    assert ours.rope.theta == params["rope_theta"]
    assert ours.rope.rope_type == params["rope_type"]
    if params["rope_type"] == "yarn":
        assert ours.rope.factor == params["factor"]
        original = params["original_max_position_embeddings"]
        assert ours.rope.original_max_position_embeddings == original
        assert ours.rope.truncate == params.get("truncate", True)


@pytest.mark.parametrize("name", [n for n in CASES if "rope" in n or "yarn" in n or "scaling" in n
                                  or n in ("full", "no-head-dim", "no-max-pos-yarn-bare",
                                           "no-sizes", "initial-context-length-ignored")])
def test_rope_frequencies_equal_transformers(name):
    cfg = _config_dict(name)
    ours, hf = GptOssConfig.from_dict(cfg), _transformers_config(cfg)
    inv_freq, scale = inverse_frequencies(ours.rope, ours.head_dim)
    ref_freq, ref_scale = _transformers_rope(hf)
    torch.testing.assert_close(inv_freq, ref_freq.float(), rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_missing_rope_scaling_is_gpt_oss_yarn():
    """The bug this guards: no rope_scaling used to mean plain RoPE here, YaRN ×32 in
    transformers."""
    rope = GptOssConfig.from_dict(_config_dict("no-rope-at-all")).rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.beta_fast, rope.beta_slow,
            rope.original_max_position_embeddings, rope.truncate) == ("yarn", 150000.0, 32.0, 32.0,
                                                                      1.0, 4096, False)


@pytest.mark.parametrize("where", ["top", "rope"])
def test_partial_rotary_is_refused_not_misread(where):
    cfg = _config_dict("full")
    if where == "top":
        cfg["partial_rotary_factor"] = 0.5
    else:
        cfg["rope_scaling"]["partial_rotary_factor"] = 0.5
    with pytest.raises(CheckpointError,
                       match=r"partial_rotary_factor 0.5: kvrelay rotates every head dim"):
        GptOssConfig.from_dict(cfg)


def test_checkpoint_files_load_as_transformers_reads_them(tmp_path):
    """A checkpoint written by transformers' save_pretrained (what the model tests use) reads
    back with the same fields as the config object that wrote it."""
    from tests.factories import TINY
    hf = _transformers_config({"model_type": "gpt_oss"} | TINY)
    hf.save_pretrained(tmp_path)
    ours = load_config(tmp_path)
    assert (ours.head_dim, ours.num_key_value_heads, ours.sliding_window,
            ours.num_local_experts) == \
        (hf.head_dim, hf.num_key_value_heads, hf.sliding_window, hf.num_local_experts)
    torch.testing.assert_close(inverse_frequencies(ours.rope, ours.head_dim)[0],
                               _transformers_rope(hf)[0].float(), rtol=0, atol=0)
