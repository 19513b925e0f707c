"""KVRELAY_CPU_ISA: the kernels' ISA capped at a variant (kernels/isa.py `cap`), so that a
lesser CPU's kernels run on this one, and the plan's CPU-keyed choices made as that CPU's.

These tests move the Python side only (the environment and, where they need another CPU,
`isa.hardware_features`); the loaded library keeps this process's cap, which C++ reads once:
tests/engine/test_cpu_isa_generic.py runs a capped process end to end."""
from __future__ import annotations

import pytest
import torch

from kvrelay import envs
from kvrelay.model import kernels
from kvrelay.model.execution_plan import CpuFeatures, ExecutionPlan, KernelFacts, PlanConfig
from kvrelay.model.kernels import isa

AVX2_CPU = frozenset({"avx", "avx2", "fma", "f16c", "popcnt"})
SAPPHIRE = isa.ISA_FEATURES["avx512_bf16"] | {"avx", "amx_tile", "amx_bf16"}
TORCH_PROBES = ("_is_avx2_supported", "_is_avx512_supported", "_is_avx512_bf16_supported",
                "_is_amx_tile_supported")


@pytest.fixture
def capped(monkeypatch):
    """`capped(value, hardware=None)`: KVRELAY_CPU_ISA=value on a CPU with `hardware`'s
    features (this one's by default); afterwards this process's own cap again."""
    def cap(value: str, hardware: frozenset[str] | None = None) -> None:
        monkeypatch.setenv(envs.CPU_ISA.name, value)
        if hardware is not None:
            monkeypatch.setattr(isa, "hardware_features", lambda: hardware)
        isa.cap.cache_clear()
    yield cap
    monkeypatch.undo()
    isa.cap.cache_clear()


@pytest.fixture
def sapphire_torch(monkeypatch):
    """torch's CPU probes answering as on an AMX Xeon with oneDNN's bf16 GEMM."""
    for name in TORCH_PROBES:
        monkeypatch.setattr(torch.cpu, name, lambda: True, raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)


def test_the_cap_is_a_ceiling_for_every_family(capped):
    capped("generic", SAPPHIRE)
    assert isa.cpu_features() == frozenset()
    for family in isa.FAMILIES.values():
        assert isa.variants(family.name) == (("generic",) if "generic" in family.variants
                                             else ()), family.name
    assert isa.best("moe_tile") is None
    capped("avx512", SAPPHIRE)
    assert isa.variants("moe") == ("avx512", "avx2", "generic")
    assert isa.best("dense") == "avx512" and isa.variants("moe_tile") == ()
    assert isa.why_not("moe", "avx512_bf16") == (
        "moe avx512_bf16 build: above KVRELAY_CPU_ISA=avx512")
    assert "above KVRELAY_CPU_ISA=avx512: avx512_bf16;" in isa.report()
    capped("native", SAPPHIRE)
    assert isa.cap() is None and isa.variants("moe_tile") == ("avx512_bf16",)


def test_an_unknown_cap_or_one_above_this_cpu_is_a_clear_error(capped):
    with pytest.raises(ValueError, match=r"^KVRELAY_CPU_ISA: expected native, generic, avx2, "
                                         r"avx512 or avx512_bf16, got 'sse2'$"):
        isa.parse_cap("sse2", AVX2_CPU)
    with pytest.raises(ValueError, match=r"^KVRELAY_CPU_ISA=avx512: this CPU cannot run it "
                                         r"\(its best is avx2; it lacks avx512bw, avx512dq, "
                                         r"avx512f, avx512vl\)$"):
        isa.parse_cap("avx512", AVX2_CPU)
    assert isa.parse_cap("avx2", AVX2_CPU) == "avx2" and isa.parse_cap("native", AVX2_CPU) is None
    # at start-up: the plan's CPU facts and the kernels' status raise it (no silent downgrade)
    capped("avx512_bf16", AVX2_CPU)
    with pytest.raises(ValueError, match="its best is avx2"):
        CpuFeatures.detect()
    with pytest.raises(ValueError, match="its best is avx2"):
        kernels.status.__wrapped__()


def test_a_forced_isa_hides_the_features_above_it_from_the_plan(capped, sapphire_torch):
    """An AMX Xeon capped at AVX2 plans as an AVX2 CPU does: fp32 half matmuls (numerics
    included), and the log line names the forced ISA and the real one."""
    capped("native", SAPPHIRE)
    own = CpuFeatures.detect()
    assert own.amx and own.forced_isa is None and own.hardware_isa == "avx512_bf16"
    assert ExecutionPlan.build(own, KernelFacts(), PlanConfig()).matmul == "native"
    capped("avx2", SAPPHIRE)
    cpu = CpuFeatures.detect()
    assert cpu == CpuFeatures(avx2=True, onednn_bf16=True, hardware_isa="avx512_bf16",
                              forced_isa="avx2")
    plan = ExecutionPlan.build(cpu, KernelFacts(True, False, "avx2", "avx2", False),
                               PlanConfig())
    assert plan.matmul == "fp32"
    assert plan.numerics("bfloat16") == "kv=bfloat16;matmul=fp32-from-4-rows"
    assert "kernels ready, ISA avx2 (forced by KVRELAY_CPU_ISA; this CPU: avx512_bf16);" in (
        plan.describe())


def test_a_generic_plan_names_the_forced_isa_and_keeps_dense_on_torch(capped):
    capped("generic")
    cpu = CpuFeatures.detect()
    assert not (cpu.avx2 or cpu.avx512 or cpu.avx512_bf16 or cpu.amx)
    assert cpu.forced_isa == "generic" and cpu.hardware_isa == isa.top(isa.hardware_features())
    plan = ExecutionPlan.build(cpu, KernelFacts(True, False, "generic", "generic", False),
                               PlanConfig())
    assert plan.dense is None and not plan.screened_head      # generic: no dense target
    assert (f"kernels ready, ISA generic (forced by KVRELAY_CPU_ISA; this CPU: "
            f"{cpu.hardware_isa});") in plan.describe()
    building = ExecutionPlan.build(cpu, KernelFacts(False, True), PlanConfig())
    assert "kernels building, ISA generic (forced by" in building.describe()
