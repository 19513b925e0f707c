"""The tensor-parallel executor: where the model runs for a step at TP=N.

    MultiprocExecutor   rank 0's runner lives in the engine-core process, ranks 1..N-1
                        in worker processes; every step the engine's compact step input
                        (plain lists) is broadcast, all ranks run their shard, and rank 0
                        returns the (all-gathered) logits.

(TP=1 runs in the engine-core process: `kvrelay/engine/executor.py`'s UniprocExecutor,
which has the same interface.) This module is below the engine: it knows no runner or
step type; the engine hands it a runner factory (`make_runner`), and a step is whatever
that runner's `execute` takes, wrapped in `_Compute` on the wire so that ranks tell
steps from KV-transfer messages.

Supervision: a monitor thread watches the workers; if one dies the executor marks
itself failed, the engine reports a clear error and every worker is stopped.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from kvrelay.model.loader import LoadedModel

logger = logging.getLogger(__name__)


IDLE_SAFE_TIMEOUT = timedelta(days=30)


class WorkerDiedError(RuntimeError):
    pass


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to build its shard."""

    model_dir: str
    dtype: torch.dtype
    quantization: str | None
    hf_overrides: dict[str, Any] | None
    hybrid: bool
    max_positions: int
    tp_size: int
    ep_size: int
    block_size: int
    init_method: str
    cpu_slices: tuple[tuple[int, ...], ...]      # per rank: CPU cores to pin to (may be empty)
    expert_world: Any = None                     # ExpertWorld: experts span all DP replicas
    config: Any = None                           # the parsed config.json (GptOssConfig)


# (model, num_blocks, block_size) -> a runner with `.execute(step)`, `.kv_tensors`, `.num_groups`
RunnerFactory = Callable[[Any, int, int], Any]


@dataclass
class _Compute:
    """A broadcast step (every other broadcast is a KV-transfer message or None: stop)."""
    step: Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_rank(spec: RankSpec, rank: int) -> LoadedModel:
    """Pin CPU cores, join the process group, build and load this rank's shard."""
    import torch.distributed as dist

    from kvrelay.distributed.collectives import TorchDistCollectives
    from kvrelay.model.loader import load_model
    from kvrelay.model.parallel import ParallelContext

    cores = spec.cpu_slices[rank] if spec.cpu_slices else ()
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    # The timeout bounds every pending op, including a worker's wait for the next step:
    # 600 s made a TP server that stayed idle for 10 minutes lose its workers. A dead
    # peer still fails ops at once (gloo sees the closed connection; the monitor reports
    # it) and a hung step fails its requests through VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
    dist.init_process_group("gloo", init_method=spec.init_method, rank=rank,
                            world_size=spec.tp_size, timeout=IDLE_SAFE_TIMEOUT)
    if spec.expert_world is not None:
        from kvrelay.distributed.collectives import GlooExpertGroup
        w = spec.expert_world
        ctx = ParallelContext.across_replicas(rank, spec.tp_size, w.dp_rank, w.dp_size,
                                              TorchDistCollectives(), GlooExpertGroup(w, rank))
    else:
        ep_rank = rank * spec.ep_size // spec.tp_size
        ctx = ParallelContext(tp_rank=rank, tp_size=spec.tp_size, ep_rank=ep_rank,
                              ep_size=spec.ep_size, comm=TorchDistCollectives())
    loaded = load_model(spec.model_dir, dtype=spec.dtype, quantization=spec.quantization,
                        hf_overrides=spec.hf_overrides, ctx=ctx, hybrid_kv_cache=spec.hybrid,
                        max_positions=spec.max_positions, progress=rank == 0, config=spec.config)
    if spec.expert_world is not None:
        from kvrelay.model.layers.ep_dispatch import report_expert_layout
        report_expert_layout(loaded.model, ctx)
    return loaded


def worker_main(spec: RankSpec, rank: int, make_runner: RunnerFactory,
                kv_events: Any = None) -> None:
    """Ranks ≥ 1: load the shard, then run every broadcast step until told to stop.
    Other broadcasts are KV-transfer messages (kvrelay/disagg/worker.py); this rank
    reports its KV progress on `kv_events`."""
    import torch.distributed as dist
    logging.basicConfig(level=logging.WARNING)
    loaded = _setup_rank(spec, rank)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)               # num_blocks from rank 0
    runner = make_runner(loaded.model, box[0], spec.block_size)
    kv = None
    try:
        while True:
            dist.broadcast_object_list(box, src=0)
            message = box[0]
            if message is None:
                break
            if not isinstance(message, _Compute):
                from kvrelay.disagg.worker import serve_kv_message
                kv = serve_kv_message(message, kv, rank, runner.kv_tensors, kv_events)
                continue
            step = message.step
            if step.kv_work is not None and kv is not None:
                kv.apply(step.kv_work)                   # start this rank's reads before computing
            runner.execute(step)
    finally:
        if kv is not None:
            kv.close()
    dist.destroy_process_group()


class MultiprocExecutor:
    """Owner of the worker processes and the TP process group (rank 0 is this process)."""

    can_rerun = False        # the ranks' collectives cannot be replayed for part of a batch

    def __init__(self, spec: RankSpec, make_runner: RunnerFactory) -> None:
        self.spec, self.make_runner = spec, make_runner
        self.failed: str | None = None
        self._closing = False
        self._start_workers()
        threading.Thread(target=self._monitor, name="kvrelay-tp-monitor", daemon=True).start()
        try:
            self.loaded = _setup_rank(spec, 0)
        except BaseException:
            self._closing = True
            self._kill_all()
            raise
        self.model, self.config = self.loaded.model, self.loaded.config
        self.expert_world = spec.expert_world
        self.runner: Any = None

    # -- the workers: processes here; Ray actors in `distributed/ray_executor.py` ------------
    def _start_workers(self) -> None:
        ctx = mp.get_context("spawn")
        self.kv_queue: Any = ctx.Queue()             # ranks' KV-transfer progress (disaggregation)
        self.workers = [ctx.Process(target=worker_main,
                                    args=(self.spec, r, self.make_runner, self.kv_queue),
                                    name=f"kvrelay-tp-rank{r}", daemon=True)
                        for r in range(1, self.spec.tp_size)]
        for w in self.workers:
            w.start()

    def _dead_worker(self) -> str | None:
        """Which worker has exited (and how), if any."""
        dead = next((w for w in self.workers if w.exitcode is not None), None)
        if dead is None:
            return None
        return (f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code "
                f"{dead.exitcode}")

    def _join_workers(self, timeout_s: float) -> None:
        for w in self.workers:
            w.join(timeout_s)

    @property
    def link(self) -> MultiprocExecutor:
        """The KV connector's RankLink to ranks 1..N-1."""
        return self

    def _why_failed(self, error: Exception, wait_s: float = 2.0) -> str:
        """A failed collective usually means a peer died: name the worker that exited
        (the monitor may not have seen it yet) rather than the socket error."""
        deadline = time.monotonic() + wait_s
        while not self.failed and time.monotonic() < deadline:
            dead = self._dead_worker()
            if dead is not None:
                return dead
            time.sleep(0.05)
        return self.failed or f"tensor-parallel collective failed: {error}"

    def _monitor(self) -> None:
        from multiprocessing.connection import wait
        sentinels = {w.sentinel: w for w in self.workers}
        while sentinels and not self._closing:
            for s in wait(list(sentinels), timeout=1.0):
                w = sentinels.pop(cast(int, s))   # wait() returns the sentinels it was given
                if self._closing:
                    continue
                w.join(1)
                self._fail(f"tensor-parallel worker {w.name} (pid {w.pid}) exited with code "
                           f"{w.exitcode}")
                return

    def _fail(self, why: str) -> None:
        self.failed = why
        logger.error("%s; stopping the other ranks", why)
        self._kill_all()          # rank 0's pending collective then fails at once

    def start_runner(self, num_blocks: int) -> Any:
        import torch.distributed as dist
        dist.broadcast_object_list([num_blocks], src=0)
        self.runner = self.make_runner(self.model, num_blocks, self.spec.block_size)
        return self.runner

    def execute(self, step: Any) -> torch.Tensor:
        import torch.distributed as dist
        if self.failed:
            raise WorkerDiedError(self.failed)
        try:
            dist.broadcast_object_list([_Compute(step)], src=0)
            return self.runner.execute(step)
        except RuntimeError as e:       # a collective with a dead peer
            raise WorkerDiedError(self._why_failed(e)) from None

    # -- KV transfer (kvrelay/disagg/worker.py): the connector's RankLink ------------------
    def start_kv(self, setup: Any, own: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank starts its KV transport; returns each rank's transport metadata."""
        import torch.distributed as dist
        self._broadcast(setup)
        gathered: list[Any] = [None] * self.spec.tp_size
        dist.gather_object(own, gathered, dst=0)
        return gathered

    def send_kv(self, work: Any) -> None:
        """KV work for ranks 1..N-1 when no step follows to carry it."""
        self._broadcast(work)

    def kv_events(self) -> list[tuple]:
        from kvrelay.disagg.worker import drain
        return drain(self.kv_queue)

    def _broadcast(self, message: Any) -> None:
        import torch.distributed as dist
        if self.failed:
            raise WorkerDiedError(self.failed)
        try:
            dist.broadcast_object_list([message], src=0)
        except RuntimeError as e:
            raise WorkerDiedError(self._why_failed(e)) from None

    def shutdown(self) -> None:
        import torch.distributed as dist
        if self._closing:
            return
        self._closing = True
        if not self.failed:
            try:
                dist.broadcast_object_list([None], src=0)
            except Exception:  # workers may be gone already
                pass
        self._join_workers(10)
        self._kill_all()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_all(self) -> None:
        for w in self.workers:
            if w.is_alive():
                w.kill()
