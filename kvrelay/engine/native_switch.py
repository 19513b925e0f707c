"""Serving before the native CPU kernels are built, and switching to them between two steps.

    engine core starts ── NativeSwitch.start(args): kernels.build_in_background()
      model built: kernels.status() answers "building" (a thread runs the compiler: one job,
      low priority, progress in the log) and every layer takes its PyTorch reference path
      → Ready: requests are served
      ...
      between two steps (no forward in flight), `due`: the build has finished
      → `apply`: every decision made from kernels.status() is forgotten (the module caches
        in `_CACHED_DECISIONS`, the process's execution plan among them), status() is asked
        again (it loads the library, or logs the failure's one warning), the model gets the
        new plan (`GptOssModel.use_plan`: the same numerics, the kernels' paths), two
        warm-up steps into the null block; the engine core sends the new `native_paths()`
        with a second Ready

The reference paths and the kernels compute the same values up to float32 summation order
(tests/model/test_moe_kernels.py, test_paged_decode.py, test_dense_kernels.py and
test_fused_decode_layer.py compare them); a request running across the switch keeps the KV
its earlier steps wrote and continues on the kernels.

The build waits before serving, as it did before, where ranks would have to switch together
or the kernels are required from the first step: tensor parallelism, experts across
data-parallel replicas, KVRELAY_COMPILE_DECODE (its graphs are traced over the native ops),
KVRELAY_MOE_KERNEL=native; and with KVRELAY_KERNELS_BUILD=wait.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from kvrelay import envs
from kvrelay.config import EngineArgs
from kvrelay.engine import sampler
from kvrelay.engine.executor import warmup_steps
from kvrelay.model import execution_plan, kernels

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5       # while the build runs, an idle engine core looks this often

# Every cached decision read from kernels.status(), forgotten together when it changes (a
# new one belongs here: tests/engine/test_native_switch.py finds them in the source).
_CACHED_DECISIONS: tuple[Any, ...] = (      # functools.cache'd functions
    kernels.status, execution_plan.current, sampler._argmax_op)


def why_wait(args: EngineArgs) -> str | None:
    """Why this engine core builds the kernels before serving (None: in the background)."""
    mode = envs.KERNELS_BUILD.raw()
    if mode not in ("background", "wait"):
        raise ValueError(f"{envs.KERNELS_BUILD.shown}: expected background or wait, "
                         f"got {mode!r}")
    if mode == "wait":
        return f"{envs.KERNELS_BUILD.shown}=wait"
    if args.tensor_parallel_size > 1:
        return "tensor-parallel ranks would switch at different steps"
    if args.experts_across_replicas:
        return "expert-parallel replicas would switch at different steps"
    if envs.COMPILE_DECODE.raw():
        return f"{envs.COMPILE_DECODE.shown} compiles over the native kernels"
    if envs.MOE_KERNEL.raw() == "native":
        return f"{envs.MOE_KERNEL.shown}=native"
    return None


class NativeSwitch:
    """Owner of this engine core's switch to the native kernels: whether one is pending
    and applying it once, between two steps."""

    def __init__(self, pending: bool) -> None:
        self.pending = pending

    @classmethod
    def start(cls, args: EngineArgs) -> NativeSwitch:
        """Call before the model is built: from then on a missing build runs in the background."""
        why = why_wait(args)
        if why is not None:
            logger.debug("native kernels built before serving: %s", why)
            return cls(False)
        kernels.build_in_background()
        return cls(True)

    def idle_wait(self) -> float | None:
        """How long an idle engine core may sleep on its pipe (None: until a message)."""
        return IDLE_POLL_S if self.pending else None

    def due(self, pipeline_busy: bool = False) -> bool:
        """Whether to switch now: the background build has finished and no forward is in
        flight (`pipeline_busy`: async scheduling's step still computing)."""
        if not self.pending:
            return False
        build = kernels.background_build()
        if build is None:                   # nothing asked for the kernels yet
            return False
        if not kernels.status().building:   # built before the model was: nothing to switch
            self.pending = False
            return False
        return build.done.is_set() and not pipeline_busy

    def apply(self, model: Any, executor: Any, num_groups: int, block_size: int) -> bool:
        """Switch `model` to what kernels.status() now says (at a safe point: no forward
        running); returns whether the native kernels are in use."""
        self.pending = False
        started = time.perf_counter()
        for decision in _CACHED_DECISIONS:
            decision.cache_clear()
        status = kernels.status()           # loads the library, or logs why not (once)
        plan = execution_plan.current()
        if plan.numerics(str(model.dtype)) != model.plan.numerics(str(model.dtype)):
            raise RuntimeError(f"the execution plan's numerics changed at the switch to the "
                               f"native kernels: {model.plan.describe()} → {plan.describe()}")
        model.use_plan(plan)
        if not status.available:
            return False
        for step in warmup_steps(num_groups, block_size):
            executor.execute(step)
        build = kernels.background_build()
        built = build.seconds if build is not None and build.seconds is not None else 0.0
        logger.info("native kernels ready after %.0f s; switched from the PyTorch reference "
                    "paths (ISA %s, %.2f s)", built, status.isa, time.perf_counter() - started)
        return True
