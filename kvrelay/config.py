"""Engine arguments (the `serve` flags with underscores) and their validation.

`EngineArgs` is what users pass (`LLM(model, **engine_args)` or the CLI); the
engine reads the validated, frozen pieces: `NeuronConfig` from
`--additional-config '{"neuron_config": {...}}'` among them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")

NEURON_KEYS = {
    "num_batched_tokens_buckets", "num_seqs_buckets", "kv_segment_size_buckets",
    "quantization", "ep_degree", "embedding_dp_size", "lm_head_dp_size",
    "on_device_sampling_config",
}


@dataclass(frozen=True)
class NeuronConfig:
    """The tutorial's `neuron_config` keys with their meaning on CPU/CUDA.

    Buckets are the shapes graphs would be captured/compiled for; they are validated
    as Neuron does (ascending; the last equals the maximum) and used for padding only
    where a captured or compiled graph exists — eager CPU pads nothing.
    """

    num_batched_tokens_buckets: tuple[int, ...] = ()
    num_seqs_buckets: tuple[int, ...] = ()
    kv_segment_size_buckets: tuple[int, ...] = ()
    quantization: str | None = None
    ep_degree: int | None = None
    embedding_dp_size: int | None = None
    lm_head_dp_size: int | None = None
    all_greedy: bool = False

    @classmethod
    def from_additional_config(cls, additional: dict[str, Any] | None) -> NeuronConfig:
        additional = additional or {}
        unknown_top = set(additional) - {"neuron_config"}
        if unknown_top:
            raise ValueError(f"--additional-config: unknown key {sorted(unknown_top)[0]!r} "
                             f"(expected 'neuron_config')")
        nc = additional.get("neuron_config") or {}
        if not isinstance(nc, dict):
            raise ValueError("--additional-config: neuron_config must be a JSON object")
        unknown = set(nc) - NEURON_KEYS
        if unknown:
            raise ValueError(f"--additional-config: unknown neuron_config key {sorted(unknown)[0]!r}")
        sampling = nc.get("on_device_sampling_config") or {}
        if not isinstance(sampling, dict) or set(sampling) - {"all_greedy", "do_sample", "top_k",
                                                             "top_p", "temperature", "global_topk",
                                                             "dynamic"}:
            raise ValueError("--additional-config: on_device_sampling_config must be an object "
                             "such as {\"all_greedy\": true}")
        quant = nc.get("quantization")
        if quant not in (None, "mxfp4"):
            raise ValueError(f"--additional-config: neuron_config.quantization {quant!r} is not "
                             f"supported (expected \"mxfp4\")")
        return cls(
            num_batched_tokens_buckets=_buckets(nc, "num_batched_tokens_buckets"),
            num_seqs_buckets=_buckets(nc, "num_seqs_buckets"),
            kv_segment_size_buckets=_buckets(nc, "kv_segment_size_buckets"),
            quantization=quant,
            ep_degree=nc.get("ep_degree"),
            embedding_dp_size=nc.get("embedding_dp_size"),
            lm_head_dp_size=nc.get("lm_head_dp_size"),
            all_greedy=bool(sampling.get("all_greedy", False)),
        )

    def check_buckets(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        expect = {"num_batched_tokens_buckets": max_num_batched_tokens,
                  "num_seqs_buckets": max_num_seqs,
                  "kv_segment_size_buckets": max_num_batched_tokens}
        for name, maximum in expect.items():
            buckets = getattr(self, name)
            if buckets and buckets[-1] != maximum:
                flag = "--max-num-seqs" if name == "num_seqs_buckets" else "--max-num-batched-tokens"
                raise ValueError(f"neuron_config.{name}: the last bucket ({buckets[-1]}) must equal "
                                 f"{flag} ({maximum})")


def _buckets(nc: dict[str, Any], name: str) -> tuple[int, ...]:
    value = nc.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"neuron_config.{name} must be a non-empty list of positive integers")
    if any(b <= a for a, b in zip(value, value[1:])):
        raise ValueError(f"neuron_config.{name} must be strictly ascending, got {value}")
    return tuple(value)


@dataclass
class EngineArgs:
    model: str | None = None
    served_model_name: list[str] | str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_logprobs: int = 20
    seed: int = 0
    hf_overrides: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    optimization_level: int | None = None
    kv_transfer_config: dict[str, Any] | None = None
    download_dir: str | None = None
    device: str = "auto"
    quantization: str | None = None
    # "module:attr" names of factories `f(params, prompt_ids) -> processor | None` applied
    # to every request (vLLM's --logits-processors); the seam structured outputs will use
    logits_processors: list[str] = field(default_factory=list)
    # the device slice of this engine (set per data-parallel replica; else the env var)
    visible_devices: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (unlimited) or ≥ 0, got {self.max_logprobs}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument {unknown[0]!r}")
        return cls(**kwargs)
