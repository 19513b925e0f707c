"""Where the model runs: device, CPU pinning, model loading, and the executor.

    UniprocExecutor     TP=1: the runner lives in this (the engine-core) process
    MultiprocExecutor   TP=N: ranks 1..N-1 in worker processes (kvrelay/distributed/)
    RayExecutor         TP=N with --distributed-executor-backend ray: ranks 1..N-1 are
                        Ray actors (kvrelay/distributed/ray_executor.py)

Both have one interface — `model`, `config`, `start_runner(num_blocks)`, `runner`,
`execute(step)`, `send_kv(work)`, `link` (the KV connector's RankLink, None at TP=1),
`can_rerun` (a failed forward may be re-run chunk by chunk) and `shutdown()` — so the
engine never asks which one it has. `make_executor` picks and builds it from the
`EngineConfig`; with experts across data-parallel replicas it also joins the expert
world (`executor.expert_world`), where every replica must run each forward together.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from kvrelay import envs
from kvrelay.config import EngineConfig
from kvrelay.distributed.tp_workers import MultiprocExecutor, RankSpec, free_port
from kvrelay.engine.runner import ModelRunner, StepInput
from kvrelay.kv_cache.manager import KVCacheGroup
from kvrelay.model.loader import LoadedModel, load_model
from kvrelay.model.parallel import cpu_slices

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(device)


class UniprocExecutor:
    """TP=1: owner of the one runner, in this process."""

    link = None                  # no other ranks to reach

    def __init__(self, loaded: LoadedModel, block_size: int, device: torch.device,
                 expert_world: Any = None) -> None:
        self.loaded, self.model, self.config = loaded, loaded.model, loaded.config
        self.block_size, self.device, self.expert_world = block_size, device, expert_world
        # with experts across replicas every replica's forward is one collective: no re-runs
        self.can_rerun = expert_world is None
        self.runner: ModelRunner | None = None

    def start_runner(self, num_blocks: int) -> ModelRunner:
        self.runner = ModelRunner(self.model, num_blocks, self.block_size, self.device)
        return self.runner

    def execute(self, step: StepInput) -> torch.Tensor:
        return self.runner.execute(step)     # type: ignore[union-attr]

    def send_kv(self, work: Any) -> None:
        """KV work only ever goes to other ranks; there are none."""

    def shutdown(self) -> None:
        pass


Executor = UniprocExecutor | MultiprocExecutor


def make_executor(config: EngineConfig, device: torch.device) -> Executor:
    """Load the model where it runs: in this process (TP=1) or on every TP rank."""
    expert_world = _expert_world(config)
    _pin_cpus(config, device)
    if config.args.tensor_parallel_size > 1:
        if config.args.distributed_executor_backend == "ray":
            from kvrelay.distributed.ray_executor import RayExecutor
            return RayExecutor(_rank_spec(config, expert_world), _make_runner,
                               config.args.ray_address)
        return MultiprocExecutor(_rank_spec(config, expert_world), _make_runner)
    a, ctx = config.args, _replica_context(expert_world)
    loaded = load_model(config.model_dir, dtype=TORCH_DTYPES[config.dtype],
                        quantization=config.quantization, hf_overrides=a.hf_overrides,
                        device=device, hybrid_kv_cache=not a.disable_hybrid_kv_cache_manager,
                        max_positions=a.max_model_len, ctx=ctx, config=config.model)
    if ctx is not None:
        from kvrelay.model.layers.ep_dispatch import report_expert_layout
        report_expert_layout(loaded.model, ctx)
    return UniprocExecutor(loaded, a.block_size, device, expert_world)


def kv_groups(model: Any) -> list[KVCacheGroup]:
    """The KV-cache groups of the model's layers: one per layer group, with its sliding
    window (a group mixing full and sliding layers — hybrid manager off — keeps every block)."""
    groups = model.layer_groups
    out = []
    for g in range(max(groups) + 1):
        layers = [i for i, x in enumerate(groups) if x == g]
        windows = {model.config.window_of(i) for i in layers}
        window = windows.pop() if len(windows) == 1 else None
        out.append(KVCacheGroup(window=window, num_layers=len(layers)))
    return out


def _make_runner(model: Any, num_blocks: int, block_size: int) -> ModelRunner:
    """Every TP rank's runner (picklable: the worker processes build theirs with it)."""
    return ModelRunner(model, num_blocks, block_size)


def warmup_steps(num_groups: int, block_size: int, dp_size: int | None = None) -> list[StepInput]:
    """One small prefill and one decode writing only into the null block (first-call
    kernel set-up); with experts across replicas every replica runs the same two."""
    n = min(block_size, 8)
    tables = [[[0]] for _ in range(num_groups)]
    steps = [StepInput([0] * n, [n], [0], tables, [n - 1]),
             StepInput([0], [1], [n - 1], tables, [0], num_decodes=1)]
    if dp_size is not None:
        for step in steps:
            step.dp_token_counts = (len(step.token_ids),) * dp_size
    return steps


def warmup(executor: Executor, num_groups: int, config: EngineConfig) -> None:
    """Run the warm-up steps; taking longer than the compilation timeout is an error."""
    limit = envs.COMPILATION_TIMEOUT_S.as_float()
    dp = config.args.data_parallel_size if executor.expert_world is not None else None
    t0 = time.perf_counter()
    for step in warmup_steps(num_groups, config.args.block_size, dp):
        executor.execute(step)
    head = ""
    if isinstance(executor, UniprocExecutor) and executor.runner is not None:
        executor.runner.compile_decode()           # KVRELAY_COMPILE_DECODE's buckets, if any
        # the screened LM head's copy and per-key checks, not in the first greedy requests
        t1 = time.perf_counter()
        rows = executor.runner.warm_greedy_head(config.args.max_num_seqs)
        if rows:
            head = (f" (the screened LM head's copy and checks for {rows} row counts: "
                    f"{time.perf_counter() - t1:.2f}s)")
    seconds = time.perf_counter() - t0
    if limit is not None and seconds > limit:
        raise TimeoutError(f"warm-up took {seconds:.0f}s, over the {limit:.0f}s allowed; "
                           f"raise {envs.COMPILATION_TIMEOUT_S.shown}")
    logger.info("warm-up done in %.2fs%s", seconds, head)


def dummy_step(num_groups: int) -> StepInput:
    """One padding token written to the null block: a replica with no work of its own
    still joins a lockstep forward (as warm-up does)."""
    tables = [[[0]] for _ in range(num_groups)]
    return StepInput([0], [1], [0], tables, [0], num_decodes=1)


def _pin_cpus(config: EngineConfig, device: torch.device) -> None:
    """TP=1 on CPU: run on the device slice (NEURON_VISIBLE_DEVICES / per DP replica)."""
    visible = config.args.visible_devices or envs.VISIBLE_DEVICES.raw()
    if visible and device.type == "cpu" and config.args.tensor_parallel_size == 1:
        cores = envs.parse_id_list(visible)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        logger.info("pinned to CPU cores %s", cores)


def _expert_world(config: EngineConfig) -> Any:
    """EP across DP replicas: where this replica's ranks meet the others' (None otherwise)."""
    a = config.args
    if not config.experts.across:
        return None
    from kvrelay.distributed.collectives import ExpertWorld
    if a.data_parallel_master_port is None:
        raise ValueError("expert parallelism across replicas needs the expert world's port "
                         "(set by the data-parallel launcher)")
    timeout = envs.EXECUTE_MODEL_TIMEOUT_S.as_float() or 600.0
    return ExpertWorld(a.data_parallel_address, a.data_parallel_master_port, a.data_parallel_rank,
                       a.data_parallel_size, a.tensor_parallel_size,
                       max(timeout, envs.ENGINE_READY_TIMEOUT_S.as_float() or 0.0))


def _replica_context(expert_world: Any) -> Any:
    """TP=1 with experts across replicas: this process is one rank of the expert group."""
    if expert_world is None:
        return None
    from kvrelay.distributed.collectives import GlooExpertGroup
    from kvrelay.model.parallel import NoCollectives, ParallelContext
    w = expert_world
    return ParallelContext.across_replicas(0, 1, w.dp_rank, w.dp_size, NoCollectives(),
                                           GlooExpertGroup(w, 0))


def _rank_spec(config: EngineConfig, expert_world: Any) -> RankSpec:
    a = config.args
    visible = a.visible_devices or envs.VISIBLE_DEVICES.raw()
    cores = envs.parse_id_list(visible) if visible else sorted(os.sched_getaffinity(0))
    return RankSpec(str(config.model_dir), TORCH_DTYPES[config.dtype], config.quantization,
                    a.hf_overrides, not a.disable_hybrid_kv_cache_manager, config.max_model_len,
                    a.tensor_parallel_size, config.experts.inner, a.block_size,
                    f"tcp://127.0.0.1:{free_port()}", cpu_slices(cores, a.tensor_parallel_size),
                    expert_world=expert_world, config=config.model)
