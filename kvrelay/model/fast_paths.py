"""What this process's CPU fast paths resolved to, for the server's metrics.

Sent once with the engine core's "ready" message and exported as
`kvrelay:native_kernels_available` / `kvrelay:half_matmul_path`. It sits above the layers
and the kernels they call, so neither has to know about the other's choice.
"""
from __future__ import annotations

from typing import Any

from kvrelay.model import kernels
from kvrelay.model.layers import linear, moe, paged_decode


def native_paths() -> dict[str, Any]:
    """{"kernels": {"moe": "avx512" | None, "paged_decode": ..., "dense": "avx512_bf16" | ...},
    "build": "ready" | "building" | "failed", "half_matmul": "native"|"fp32"}

    A kernel is None where its PyTorch reference path serves it: the build failed (the
    one warning `kernels.status()` logs says why) or is still running in the background
    (`engine/native_switch.py`), or KVRELAY_MOE_KERNEL=torch /
    KVRELAY_ATTENTION_KERNEL=reference / KVRELAY_DENSE_KERNEL=torch turned it off (then
    nothing is built for it). "dense" is the decode-sized matmuls' and norms' kernel."""
    status = kernels.status()
    moe_on = moe.moe_kernel_mode() != "torch" and status.available
    return {
        "kernels": {"moe": status.isa if moe_on else None,
                    "paged_decode": status.isa if paged_decode.enabled() else None,
                    "dense": linear.dense_kernel_isa() if status.available else None},
        "build": "ready" if status.available else "building" if status.building else "failed",
        "half_matmul": "native" if linear.half_matmul_choice().native else "fp32",
    }
