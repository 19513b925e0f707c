"""Item 4 of issue 12, as issue 31 left it: native half precision only where the running
CPU has AMX (its bf16 GEMM beats fp32 compute), decided from the CPU's features and
KVRELAY_CPU_HALF_MATMUL alone — never from a timing — so two servers on alike machines
compute alike. The timing survives as `measure_half_matmul`, a suggestion."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kvrelay.model import execution_plan
from kvrelay.model.layers import linear as L


@pytest.fixture
def decide(monkeypatch):
    """Re-plan with a given CPU (features as torch.cpu reports them, oneDNN's bf16 support)
    and env mode; a probe that would say anything is never asked."""
    monkeypatch.setattr(L, "measure_half_matmul", lambda: pytest.fail("timed at start-up"))

    def run(avx512_bf16: bool, amx: bool, mode: str | None = None,
            onednn: bool = True) -> L.HalfMatmulChoice:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
        if mode is None:
            monkeypatch.delenv("KVRELAY_CPU_HALF_MATMUL", raising=False)
        else:
            monkeypatch.setenv("KVRELAY_CPU_HALF_MATMUL", mode)
        execution_plan.current.cache_clear()
        return L.half_matmul_choice()
    yield run
    execution_plan.current.cache_clear()


@pytest.mark.parametrize("avx512_bf16,amx,features", [
    (False, True, ("amx",)), (True, True, ("amx", "avx512_bf16")),
])
def test_auto_is_native_with_amx(decide, avx512_bf16, amx, features):
    choice = decide(avx512_bf16, amx)
    assert choice.native and choice.cpu_features == features
    assert not L.upcasts(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_auto_computes_in_fp32_on_avx512_bf16_without_amx(decide):
    # an AVX512-BF16 Xeon without AMX: oneDNN's bf16 GEMM ran at ~75 GFLOP/s a core, fp32 ~100
    choice = decide(True, False)
    assert not choice.native and choice.cpu_features == ("avx512_bf16",)
    assert "without AMX" in choice.reason
    assert choice.upcast_min_rows == L.UPCAST_MIN_ROWS == L.upcast_min_rows()
    assert L.upcasts(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert decide(True, False, "native").native                  # the env still wins


def test_auto_computes_in_fp32_without_native_bf16(decide):
    # AVX2-only, or AVX-512 without BF16 (Skylake-SP): oneDNN would emulate bf16
    choice = decide(False, False)
    assert not choice.native and "no AVX512-BF16 or AMX" in choice.reason
    assert L.upcasts(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert "oneDNN without bf16" in decide(True, True, onednn=False).reason


def test_linear_upcasts_from_the_plans_row_count(decide):
    decide(False, False)                                         # from UPCAST_MIN_ROWS rows
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=g).bfloat16()           # too big for the dense kernel
    rows = L.UPCAST_MIN_ROWS
    for n, upcast in ((rows - 1, False), (rows, True), (200, True)):
        x = torch.randn(n, 512, generator=g).bfloat16()
        want = F.linear(x.float(), w.float()).bfloat16() if upcast else F.linear(x, w)
        assert torch.equal(L.linear(x, w), want), n


def test_the_measurement_times_both_precisions_and_the_upcast():
    half, fp32, upcast = L.measure_half_matmul()
    assert 0 < half < 5 and 0 < fp32 < 5 and 0 < upcast < 5
    assert torch.get_num_threads() >= 1


def test_env_overrides_the_cpu(decide):
    assert decide(True, True, "fp32").native is False
    assert decide(False, False, "native").native is True
    assert "KVRELAY_CPU_HALF_MATMUL=native" in L.half_matmul_choice().reason
    with pytest.raises(ValueError, match="KVRELAY_CPU_HALF_MATMUL: expected auto, native or fp32"):
        decide(False, False, "fast")


def test_decided_and_logged_once_at_construction(decide, caplog):
    decide(False, False)
    execution_plan.current.cache_clear()
    from kvrelay.model.parallel import ParallelContext
    with caplog.at_level(logging.INFO, logger="kvrelay.model.execution_plan"):
        layer = L.RowParallelLinear(32, 16, ParallelContext(), torch.bfloat16)
        L.RowParallelLinear(16, 32, ParallelContext(), torch.bfloat16)
        layer(torch.randn(8, 32).bfloat16())
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert len(lines) == 1
    assert "half matmuls fp32 (no AVX512-BF16 or AMX on this CPU)" in lines[0]
