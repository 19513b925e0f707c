"""The model facts a parallel layout depends on, without loading the model.

A checkpoint directory's config.json is parsed by `kvrelay.model.config` (torch-free);
the hub ids `openai/gpt-oss-120b` and `openai/gpt-oss-20b` have built-in configs so a
topology can be checked on a machine that has neither checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.model.config import GptOssConfig, load_config
from kvrelay.model.embedded import EMBEDDED_MODEL_NAME

_GPT_OSS_COMMON: dict[str, Any] = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_experts_per_tok": 4,
    "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0,
                                           "original_max_position_embeddings": 4096,
                                           "truncate": False},
    "swiglu_limit": 7.0, "attention_bias": True, "torch_dtype": "bfloat16",
    "eos_token_id": 200002, "pad_token_id": 199999,
}

# config.json of the published checkpoints (the fields the layout and KV maths need)
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "openai/gpt-oss-120b": _GPT_OSS_COMMON | {"num_hidden_layers": 36, "num_local_experts": 128},
    "openai/gpt-oss-20b": _GPT_OSS_COMMON | {"num_hidden_layers": 24, "num_local_experts": 32},
}


@dataclass(frozen=True)
class TutorialDefaults:
    """What the tutorial runs for a model: its decode layout and decode-only flags."""

    decode_tp: int
    decode_dp: int
    decode_optimization_level: int | None

    @property
    def decode_ep(self) -> int:
        return self.decode_tp * self.decode_dp


TUTORIAL: dict[str, TutorialDefaults] = {
    "openai/gpt-oss-120b": TutorialDefaults(decode_tp=8, decode_dp=8, decode_optimization_level=2),
    "openai/gpt-oss-20b": TutorialDefaults(decode_tp=8, decode_dp=4,
                                           decode_optimization_level=None),
}


def model_config(model: str | None, served_name: str | None = None) -> GptOssConfig:
    """The config of `model`: a checkpoint directory's config.json, else a built-in id
    (the directory's served name may be a built-in id too, but its own file wins); None is
    kvrelay serve's embedded default model (built into the cache on first use)."""
    if model is None:
        from kvrelay.model.embedded import embedded_model_dir  # builds once (with torch)
        return load_config(embedded_model_dir())
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return load_config(path)
    for name in (model, served_name):
        if name in BUILTIN_CONFIGS:
            return GptOssConfig.from_dict(BUILTIN_CONFIGS[name],
                                          source=f"built-in config of {name}")
    known = ", ".join(BUILTIN_CONFIGS)
    raise ValueError(f"model {model!r}: no config.json there and not a built-in id ({known}); "
                     f"pass a checkpoint directory")


def served_name_of(model: str | None, served_name: str | None) -> str:
    """The name requests must use: --served-model-name, else the model as given."""
    return served_name or model or EMBEDDED_MODEL_NAME


def tutorial_defaults(model: str | None, served_name: str | None = None) -> TutorialDefaults | None:
    return TUTORIAL.get(model or "") or TUTORIAL.get(served_name or "")
