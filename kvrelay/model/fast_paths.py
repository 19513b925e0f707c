"""What this process's CPU fast paths resolved to, for the server's metrics.

Sent once with the engine core's "ready" message and exported as
`kvrelay:native_kernels_available` / `kvrelay:half_matmul_path`: this process's
`ExecutionPlan` (model/execution_plan.py) and the kernels' build state.
"""
from __future__ import annotations

from typing import Any

from kvrelay.model import execution_plan, kernels


def native_paths() -> dict[str, Any]:
    """{"kernels": {"moe": "avx512" | None, "paged_decode": ..., "dense": "avx512_bf16" | ...},
    "build": "ready" | "building" | "failed", "half_matmul": "native"|"fp32"}

    A kernel is None where its PyTorch reference path serves it: the build failed (the
    one warning `kernels.status()` logs says why) or is still running in the background
    (`engine/native_switch.py`), or KVRELAY_MOE_KERNEL=torch /
    KVRELAY_ATTENTION_KERNEL=reference / KVRELAY_DENSE_KERNEL=torch turned it off (then
    nothing is built for it). "dense" is the decode-sized matmuls' and norms' kernel."""
    status = kernels.status()
    plan = execution_plan.current()
    return {
        "kernels": {"moe": status.isa if plan.moe_native else None,
                    "paged_decode": status.isa if plan.attention == "native" else None,
                    "dense": plan.dense if status.available else None},
        "build": "ready" if status.available else "building" if status.building else "failed",
        "half_matmul": plan.matmul,
    }
