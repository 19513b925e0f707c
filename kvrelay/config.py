"""Engine arguments (the `serve` flags with underscores), their validation and resolution.

    EngineArgs     what users pass (`LLM(model, **engine_args)` or the CLI), as given,
                   each flag checked (and `--speculative-config` kept parsed: `speculative`)
    EngineConfig   what every entry point reads: the arguments resolved once against
                   the checkpoint (model directory, parsed config.json and a draft
                   model's, checked against each other, dtype,
                   max_model_len, expert-parallel layout, KV budget, quantization,
                   `NeuronConfig`, `KVTransferConfig`), frozen and validated
    ExpertLayout   the one EP-width rule (`kvrelay serve`, the engine, `kvrelay deploy`)

This module imports no torch: the API process and `kvrelay deploy` use it; the model
directory and the layout check import what they need when called.
"""
from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.model.config import GptOssConfig, load_config
from kvrelay.model.locate import resolve_model_dir
from kvrelay.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvrelay.disagg.params import KVTransferConfig
    from kvrelay.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float16", "float32")

NEURON_KEYS = {
    "num_batched_tokens_buckets", "num_seqs_buckets", "kv_segment_size_buckets",
    "quantization", "ep_degree", "embedding_dp_size", "lm_head_dp_size",
    "on_device_sampling_config",
}


EXECUTOR_BACKENDS = ("mp", "uni", "ray")     # vLLM's names; "uni" is "mp" at TP 1


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
            raise ValueError("--additional-config: unknown neuron_config key "
                             f"{sorted(unknown)[0]!r}")
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

    def check_layout(self, tensor_parallel_size: int, data_parallel_size: int,
                     enable_expert_parallel: bool) -> None:
        """The DP-related keys against the flags. kvrelay keeps the embedding and the LM
        head in every data-parallel replica (vocab-sharded over that replica's TP ranks),
        which is what `embedding_dp_size = lm_head_dp_size = --data-parallel-size` asks for."""
        for name in ("embedding_dp_size", "lm_head_dp_size", "ep_degree"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"neuron_config.{name} must be a positive integer, got {value!r}")
        for name in ("embedding_dp_size", "lm_head_dp_size"):
            value = getattr(self, name)
            if value is not None and value != data_parallel_size:
                raise ValueError(f"neuron_config.{name} {value} must equal --data-parallel-size "
                                 f"{data_parallel_size} (the layer is replicated in every "
                                 "data-parallel replica and vocab-sharded over its "
                                 f"{tensor_parallel_size} TP ranks)")
        across = tensor_parallel_size * data_parallel_size
        if (self.ep_degree is not None and enable_expert_parallel and data_parallel_size > 1
                and self.ep_degree != across):
            raise ValueError(f"neuron_config.ep_degree {self.ep_degree} conflicts with "
                             f"--enable-expert-parallel across {data_parallel_size} data-parallel "
                             f"replicas (EP = TP {tensor_parallel_size} × DP {data_parallel_size} "
                             f"= {across}); drop ep_degree")

    def check_buckets(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        expect = {"num_batched_tokens_buckets": max_num_batched_tokens,
                  "num_seqs_buckets": max_num_seqs,
                  "kv_segment_size_buckets": max_num_batched_tokens}
        for name, maximum in expect.items():
            buckets = getattr(self, name)
            if buckets and buckets[-1] != maximum:
                flag = ("--max-num-seqs" if name == "num_seqs_buckets"
                        else "--max-num-batched-tokens")
                raise ValueError(f"neuron_config.{name}: the last bucket ({buckets[-1]}) must "
                                 f"equal {flag} ({maximum})")


def _buckets(nc: dict[str, Any], name: str) -> tuple[int, ...]:
    value = nc.get(name)
    if value is None:
        return ()
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"neuron_config.{name} must be a non-empty list of positive integers")
    if any(b <= a for a, b in itertools.pairwise(value)):
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
    # vLLM's multi-node data-parallel flags: this node runs replicas
    # [data_parallel_start_rank, + data_parallel_size_local); the head (start rank 0) also
    # runs the API server and listens for headless nodes on address:rpc_port
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    headless: bool = False
    # the device slice of this engine (set per data-parallel replica; else the env var)
    visible_devices: str | None = None
    # set per replica by the data-parallel launcher: this replica's rank, and the port of
    # the expert world (experts sharded across replicas) on data_parallel_address
    data_parallel_rank: int = 0
    data_parallel_master_port: int | None = None
    # vLLM's --async-scheduling: plan step N+1 while step N computes (engine/async_steps.py)
    async_scheduling: bool = False
    # vLLM's --kv-events-config: the prefix cache's changes published for external routers
    # (kvrelay/kv_events/)
    kv_events_config: dict[str, Any] | None = None
    # vLLM's --distributed-executor-backend ("mp": TP ranks are processes on this node;
    # "ray": Ray actors placed on a cluster, which also places DP replicas) and
    # --data-parallel-backend ("mp": this node + --headless nodes; "ray": placed by Ray)
    distributed_executor_backend: str = "mp"
    data_parallel_backend: str = "mp"
    ray_address: str | None = None          # the cluster to join; else RAY_ADDRESS, "auto"
    # vLLM's --speculative-config: n-gram or draft-model drafts verified in one forward
    # (kvrelay/spec_decode/); `speculative` is it parsed, once, with the other flags
    speculative_config: dict[str, Any] | None = None
    speculative: SpeculativeConfig | None = field(init=False, repr=False, compare=False)

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
        self._check_data_parallel()
        if self.async_scheduling and self.kv_transfer_config is not None:
            raise ValueError("--async-scheduling does not support --kv-transfer-config "
                             "(disaggregated serving) yet")
        if self.async_scheduling and self.experts_across_replicas:
            raise ValueError("--async-scheduling does not support --enable-expert-parallel "
                             "across data-parallel replicas yet")
        self.speculative = SpeculativeConfig.from_json(self.speculative_config)
        self._check_speculative()

    def _check_speculative(self) -> None:
        """--speculative-config against the other flags (its draft against the target's
        checkpoint: `EngineConfig`)."""
        if self.speculative is None:
            return
        if self.async_scheduling:
            raise ValueError("--speculative-config does not support --async-scheduling yet "
                             "(drafts need the previous step's token)")
        if self.speculative.model is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"--speculative-config: a draft model with --tensor-parallel-size "
                             f"{self.tensor_parallel_size} is not supported yet (the draft "
                             f"runs beside a one-rank target)")

    def _check_data_parallel(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"--data-parallel-backend must be mp or ray, got "
                             f"{self.data_parallel_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("--distributed-executor-backend uni runs one rank; use mp or ray "
                             f"for --tensor-parallel-size {self.tensor_parallel_size}")
        if self.ray_replicas and self.headless:
            raise ValueError("--headless is the hand-run alternative to Ray placing the "
                             "replicas; drop it with --data-parallel-backend ray")
        dp, local = self.data_parallel_size, self.local_replicas
        start = self.data_parallel_start_rank
        if self.tensor_parallel_size < 1 or dp < 1:
            raise ValueError(f"--tensor-parallel-size ({self.tensor_parallel_size}) and "
                             f"--data-parallel-size ({dp}) must be at least 1")
        if not 1 <= local <= dp:
            raise ValueError(f"--data-parallel-size-local {local} must be between 1 and "
                             f"--data-parallel-size {dp}")
        if start < 0 or start + local > dp:
            raise ValueError(f"--data-parallel-start-rank {start} + --data-parallel-size-local "
                             f"{local} exceeds --data-parallel-size {dp}")
        if self.headless and start == 0:
            raise ValueError("--headless needs --data-parallel-start-rank ≥ 1 (rank 0 runs on the "
                             "head node with the API server)")
        if not self.headless and start != 0:
            raise ValueError(f"--data-parallel-start-rank {start} is for a --headless node; the "
                             "head node runs ranks from 0")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ValueError("--data-parallel-rpc-port must be a TCP port, got "
                             f"{self.data_parallel_rpc_port}")

    @property
    def ray_replicas(self) -> bool:
        """Ray places the data-parallel replicas beyond this node's."""
        return "ray" in (self.data_parallel_backend, self.distributed_executor_backend)

    @property
    def local_replicas(self) -> int:
        """Replicas this node runs (--data-parallel-size-local, default: all of them; with
        Ray placing replicas, one: the API server's, the rest go where Ray puts them)."""
        if self.data_parallel_size_local is None:
            return 1 if self.ray_replicas else self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def experts_across_replicas(self) -> bool:
        """Experts sharded over every rank of every DP replica (EP = TP × DP)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument {unknown[0]!r}")
        return cls(**kwargs)


# -- resolution --------------------------------------------------------------------------------
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_KV_BYTES = 1 << 30        # the KV budget when neither blocks nor bytes are given
# vLLM kv_transfer_config keys kvrelay accepts (the tutorial passes some) and does not use:
# NIXL needs no rank/world/address (the side channel exchanges them), and the KV blocks are
# registered where the engine keeps them
_IGNORED_KV_KEYS = ("kv_ip", "kv_port", "kv_rank", "kv_parallel_size")


@dataclass(frozen=True)
class ExpertLayout:
    """How the experts are split: the one EP-width rule.

    With --enable-expert-parallel and DP > 1 the experts span every rank of every
    replica (EP = TP × DP, `across`); otherwise inside one replica:
    neuron_config.ep_degree, else TP with --enable-expert-parallel, else 1.
    """

    tp: int
    dp: int
    inner: int            # EP width inside one replica (1 when the experts span replicas)
    across: bool          # experts span all data-parallel replicas

    @classmethod
    def of(cls, tp: int, dp: int, enable_expert_parallel: bool,
           ep_degree: int | None = None) -> ExpertLayout:
        across = enable_expert_parallel and dp > 1
        inner = 1 if across else ep_degree or (tp if enable_expert_parallel else 1)
        return cls(tp, dp, inner, across)

    @property
    def width(self) -> int:
        """Ways the experts are split in all."""
        return self.tp * self.dp if self.across else self.inner

    def validate(self, model: GptOssConfig) -> None:
        """ValueError naming the numbers when the model cannot be sharded this way."""
        from kvrelay.model.parallel import validate_layout  # imports torch
        validate_layout(model.num_attention_heads, model.num_key_value_heads,
                        model.num_local_experts, self.tp, self.width,
                        self.dp if self.across else 1)


def served_names(args: EngineArgs) -> tuple[str, ...]:
    """--served-model-name, else the --model as given, else the embedded model's name."""
    names = args.served_model_name
    if isinstance(names, str):
        names = [names]
    if names:
        return tuple(names)
    if args.model is None:
        from kvrelay.model.embedded import EMBEDDED_MODEL_NAME
        return (EMBEDDED_MODEL_NAME,)
    return (args.model,)


@dataclass(frozen=True)
class EngineConfig:
    """`EngineArgs` resolved against the checkpoint, once per process, then read-only.

    `args` are the user's arguments with `model` replaced by the resolved directory (so
    a process handed `args` resolves the same checkpoint without searching again); the
    original --model survives in `served_names`.
    """

    args: EngineArgs
    model_dir: Path
    model: GptOssConfig                      # config.json with --hf-overrides, read once
    dtype: str                               # bfloat16 | float16 | float32 (no "auto")
    quantization: str | None                 # what load_model gets: "auto", "mxfp4" or None
                                             # (dequantise: `kvrelay generate --quantization none`)
    max_model_len: int
    max_num_batched_tokens: int
    experts: ExpertLayout
    neuron: NeuronConfig
    kv_transfer: KVTransferConfig | None
    served_names: tuple[str, ...]
    kv_events: KVEventsConfig | None = None  # --kv-events-config (None: unset)
    speculative: SpeculativeConfig | None = None   # --speculative-config (None: unset)
    draft: GptOssConfig | None = None        # its draft model's config.json, read once

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES[1:]:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES[1:])}, got {self.dtype!r}")
        if self.quantization not in ("auto", "mxfp4", None):
            raise ValueError(f"quantization must be mxfp4, auto or none, got {self.quantization!r}")
        self.neuron.check_layout(self.args.tensor_parallel_size, self.args.data_parallel_size,
                                 self.args.enable_expert_parallel)
        self.neuron.check_buckets(self.max_num_batched_tokens, self.args.max_num_seqs)
        self.experts.validate(self.model)
        self._check_draft()

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:
        """Resolve and validate; ValueError (one line, naming the flag) on a bad value."""
        from kvrelay.disagg.params import KVTransferConfig
        from kvrelay.kv_events.config import KVEventsConfig
        neuron = NeuronConfig.from_additional_config(args.additional_config)
        quantization = _quantization(args.quantization, neuron.quantization)
        names = served_names(args)
        kv_transfer = KVTransferConfig.from_json(args.kv_transfer_config)
        kv_events = KVEventsConfig.from_json(args.kv_events_config)
        model_dir = resolve_model_dir(args.model, args.download_dir)
        model = load_config(model_dir, args.hf_overrides)
        draft_dir = args.speculative.model if args.speculative is not None else None
        draft = load_config(Path(draft_dir)) if draft_dir is not None else None
        dtype = args.dtype if args.dtype != "auto" else _checkpoint_dtype(model)
        return cls(
            args=replace(args, model=str(model_dir)),
            model_dir=model_dir,
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_model_len=args.max_model_len or model.max_position_embeddings,
            max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            experts=ExpertLayout.of(args.tensor_parallel_size, args.data_parallel_size,
                                    args.enable_expert_parallel, neuron.ep_degree),
            neuron=neuron,
            kv_transfer=kv_transfer,
            served_names=names,
            kv_events=kv_events,
            speculative=args.speculative,
            draft=draft,
        )

    def _check_draft(self) -> None:
        """--speculative-config's draft model against the target (one line each): its token
        ids must mean the target's — the same vocab size and, where both checkpoints have
        one, the same tokenizer vocabulary."""
        spec, draft = self.speculative, self.draft
        if spec is None or spec.model is None or draft is None:
            return
        draft_dir = spec.model
        if draft.vocab_size != self.model.vocab_size:
            raise ValueError(f"--speculative-config: draft model {draft_dir!r} has vocab_size "
                             f"{draft.vocab_size}, the target {self.model.vocab_size}: a draft "
                             f"must share the target's tokenizer")
        mine, theirs = self.model_dir / "tokenizer.json", Path(draft_dir) / "tokenizer.json"
        if mine.is_file() and theirs.is_file() and _vocab(mine) != _vocab(theirs):
            raise ValueError(f"--speculative-config: draft model {draft_dir!r} has another "
                             f"tokenizer than the target's: a draft must share the target's "
                             f"tokenizer")

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of max_model_len needs (plus the null block)."""
        return -(-self.max_model_len // self.args.block_size) + 1

    def num_blocks(self, bytes_per_block: int) -> int:
        """The KV pool size: --num-gpu-blocks-override, else --kv-cache-memory-bytes, else
        the default budget capped at what every sequence at full length could use."""
        a = self.args
        if a.num_gpu_blocks_override:
            num_blocks = a.num_gpu_blocks_override
        elif a.kv_cache_memory_bytes:
            num_blocks = a.kv_cache_memory_bytes // bytes_per_block
        else:
            most = a.max_num_seqs * (self.blocks_per_sequence - 1) + 1
            num_blocks = min(DEFAULT_KV_BYTES // bytes_per_block, most)
        if num_blocks < self.blocks_per_sequence:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {a.block_size} tokens but one "
                f"sequence of max_model_len {self.max_model_len} needs {self.blocks_per_sequence}; "
                f"raise --kv-cache-memory-bytes (now {num_blocks * bytes_per_block} bytes) or "
                f"lower --max-model-len")
        return num_blocks

    def ignored_inputs(self, device_type: str) -> list[str]:
        """Accepted-but-unused inputs, one message each (the engine logs them once)."""
        raw = self.args.kv_transfer_config or {}
        ignored = [k for k in _IGNORED_KV_KEYS if k in raw]
        notes = []
        if ignored:
            notes.append(f"--kv-transfer-config: {', '.join(ignored)} ignored (vLLM P2P keys; "
                         f"NIXL peers exchange addresses over the side channel)")
        if self.kv_transfer is not None and self.kv_transfer.kv_buffer_device != device_type:
            device = self.kv_transfer.kv_buffer_device
            notes.append(f"--kv-transfer-config: kv_buffer_device {device!r} ignored: KV blocks "
                         f"are transferred from the engine's {device_type} memory")
        return notes


def _vocab(tokenizer_json: Path) -> tuple[Any, Any]:
    """What maps token ids to text in a tokenizer.json (its model's vocab, added tokens)."""
    raw = json.loads(tokenizer_json.read_text())
    return raw.get("model", {}).get("vocab"), raw.get("added_tokens")


def _quantization(flag: str | None, neuron: str | None) -> str | None:
    """neuron_config's, else --quantization ("none": dequantise MXFP4 experts), else auto."""
    if flag == "none" and neuron is None:
        return None
    return neuron or flag or "auto"


def _checkpoint_dtype(model: GptOssConfig) -> str:
    """--dtype auto: the checkpoint's torch_dtype (bfloat16 when it names another)."""
    return model.torch_dtype if model.torch_dtype in DTYPES[1:] else "bfloat16"
