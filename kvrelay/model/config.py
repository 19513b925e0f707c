"""The gpt-oss model configuration, parsed from a checkpoint's config.json.

Owner: nothing mutable — `GptOssConfig` is frozen. It accepts both RoPE spellings
seen in the wild (`rope_scaling` + `rope_theta`, and transformers 5's
`rope_parameters`) and applies `--hf-overrides` before validation.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


class CheckpointError(ValueError):
    """A checkpoint that cannot be served, with a message naming the file and tensor."""


# transformers' GptOssConfig (5.24) defaults: a config.json that omits one of these keys is
# read with this value, exactly as transformers (and vLLM, through it) reads it.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
}
# ... and its RoPE when config.json has neither `rope_scaling` nor `rope_parameters`
HF_DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}
HF_DEFAULT_THETA = 150000.0


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters; `rope_type` is "default" (plain) or "yarn"."""

    theta: float = 150000.0
    rope_type: str = "yarn"
    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False
    attention_factor: float | None = None     # cos/sin scale; None: YaRN's 0.1·ln(factor) + 1

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}: "
                             "expected 'default' or 'yarn'")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")

    @property
    def scale(self) -> float:
        """What cos and sin are multiplied by (1 for plain RoPE)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return log_mscale(self.factor)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        """transformers' reading (PreTrainedConfig.convert_rope_params_to_dict and
        _compute_yarn_parameters): `rope_scaling` wins over `rope_parameters`; neither (or
        both empty) is gpt-oss's YaRN; a dict without a type is plain RoPE; `rope_theta`
        inside the dict wins over the top-level one; a YaRN dict lacking a key gets YaRN's
        own defaults (beta 32/1, truncate true, original context = max_position_embeddings),
        not gpt-oss's."""
        params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or HF_DEFAULT_ROPE)
        theta = params["rope_theta"] if "rope_theta" in params else cfg.get("rope_theta",
                                                                            HF_DEFAULT_THETA)
        rope_type = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(f"partial_rotary_factor {partial}: kvrelay rotates every head dim "
                             f"(gpt-oss uses 1.0)")
        if rope_type != "yarn":
            return cls(theta=float(theta), rope_type=str(rope_type), factor=1.0)
        if "factor" not in params:
            raise ValueError("rope_scaling: rope_type 'yarn' needs a 'factor'")
        max_positions = int(cfg.get("max_position_embeddings",
                                    HF_DEFAULTS["max_position_embeddings"]))
        original = int(params.get("original_max_position_embeddings", max_positions))
        factor = params["factor"]
        if factor is None:          # DeepSeek-style: implied by the two context lengths
            factor = max_positions / original
        attention = params.get("attention_factor")
        if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
            attention = (_mscale(float(factor), float(params["mscale"]))
                         / _mscale(float(factor), float(params["mscale_all_dim"])))
        return cls(
            theta=float(theta),
            rope_type="yarn",
            factor=float(factor),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            original_max_position_embeddings=original,
            truncate=bool(params.get("truncate", True)),
            attention_factor=None if attention is None else float(attention),
        )


@dataclass(frozen=True)
class GptOssConfig:
    """Architecture hyper-parameters of a gpt-oss checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope: RopeConfig
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    torch_dtype: str = "bfloat16"
    eos_token_id: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "num_local_experts", "num_experts_per_tok")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_local_experts={self.num_local_experts}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.json: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers")
        for kind in self.layer_types:
            if kind not in (SLIDING, FULL):
                raise ValueError(f"config.json: unknown layer type {kind!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("config.json: sliding_attention layers need a sliding_window")

    # -- derived -------------------------------------------------------------------
    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (keys q-W < k <= q), or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == SLIDING for t in self.layer_types)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> GptOssConfig:
        model_type = cfg.get("model_type")
        if model_type != "gpt_oss":
            raise CheckpointError(
                f"{source}: model_type is {model_type!r}; kvrelay serves gpt-oss checkpoints "
                f"(model_type 'gpt_oss')")
        try:
            return cls._from_checked_dict(cfg)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def _from_checked_dict(cls, cfg: dict[str, Any]) -> GptOssConfig:
        """Every key as transformers' GptOssConfig reads it: an absent key takes HF_DEFAULTS'
        value (not one derived from other keys: no head_dim means 64, not hidden/heads); an
        explicit null num_key_value_heads means one per attention head and a null head_dim
        hidden/heads (the class's __post_init__); `num_experts` is an alias of
        num_local_experts. OpenAI's own `experts_per_token` is not read (transformers
        ignores it)."""
        aliases = {"num_local_experts": "num_experts"}

        def get(key: str) -> Any:
            if key not in cfg and aliases.get(key) in cfg:
                return cfg[aliases[key]]
            return cfg.get(key, HF_DEFAULTS[key])

        layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        kv_heads = get("num_key_value_heads")
        head_dim = get("head_dim")
        layer_types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL
                                                 for i in range(layers)]
        window = get("sliding_window")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else int(kv_heads),
            head_dim=hidden // heads if head_dim is None else int(head_dim),
            num_local_experts=int(get("num_local_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            sliding_window=None if window is None else int(window),
            layer_types=tuple(layer_types),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=int(get("max_position_embeddings")),
            rms_norm_eps=float(get("rms_norm_eps")),
            swiglu_alpha=float(get("swiglu_alpha")),
            swiglu_limit=float(get("swiglu_limit")),
            attention_bias=bool(get("attention_bias")),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            eos_token_id=eos_ids,
            raw=cfg,
        )


def merge_overrides(cfg: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Merge `--hf-overrides` into config.json (nested dicts are replaced, as vLLM does
    for values that are themselves dicts such as `quantization_config`)."""
    merged = dict(cfg)
    for key, value in (overrides or {}).items():
        merged[key] = value
    return merged


def load_config(model_dir: Path, hf_overrides: dict[str, Any] | None = None) -> GptOssConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path}: not found; a gpt-oss checkpoint directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return GptOssConfig.from_dict(merge_overrides(raw, hf_overrides), source=str(path))


def log_mscale(factor: float) -> float:
    """YaRN's attention scaling: 0.1·ln(factor) + 1 (1 when factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
