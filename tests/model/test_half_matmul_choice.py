"""Item 4 of issue 12: native half precision only where the running CPU has it, and
where it measures faster there than fp32 compute."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kvrelay.model.layers import linear as L


@pytest.fixture
def decide(monkeypatch):
    """Re-decide with a given CPU (features as torch.cpu reports them, and the probe's
    bf16 GEMM / fp32 GEMM / weight upcast seconds) and env mode."""
    def run(avx512_bf16: bool, amx: bool, mode: str | None = None,
            probe: tuple[float, float, float] = (1.0, 2.0, 0.1)) -> L.HalfMatmulChoice:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(L, "_probe", lambda: probe)
        if mode is None:
            monkeypatch.delenv("KVRELAY_CPU_HALF_MATMUL", raising=False)
        else:
            monkeypatch.setenv("KVRELAY_CPU_HALF_MATMUL", mode)
        L.cpu_half_matmul_in_fp32.cache_clear()
        return L.half_matmul_choice()
    yield run
    L.cpu_half_matmul_in_fp32.cache_clear()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this torch/CPU has no oneDNN bf16 path at all")
@pytest.mark.parametrize("avx512_bf16,amx,features", [
    (True, False, ("avx512_bf16",)), (False, True, ("amx",)), (True, True, ("amx", "avx512_bf16")),
])
def test_auto_is_native_with_native_bf16(decide, avx512_bf16, amx, features):
    choice = decide(avx512_bf16, amx)
    assert choice.native and choice.cpu_features == features
    assert not L.upcasts(torch.zeros(2, 2, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this torch/CPU has no oneDNN bf16 path at all")
def test_auto_computes_in_fp32_where_native_bf16_measures_slower(decide):
    # an AVX512-BF16 Xeon without AMX: oneDNN's bf16 GEMM ran at ~75 GFLOP/s a core, fp32 ~100
    choice = decide(True, False, probe=(2.0, 1.5, 0.05))
    assert not choice.native and choice.cpu_features == ("avx512_bf16",)
    assert "bf16 GEMM is the slower" in choice.reason and "GFLOP/s" in choice.reason
    # 0.5 s saved over the probe's 256 rows against 0.05 s of upcast: from 26 rows on
    assert choice.upcast_min_rows == 26 == L.upcast_min_rows()
    assert L.upcasts(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert decide(True, False, "native", probe=(2.0, 1.5, 0.05)).native   # the env still wins
    assert decide(True, False, probe=(2.0, 1.9, 1.0)).upcast_min_rows == 2560
    assert decide(True, False, probe=(2.0, 1.0, 0.0)).upcast_min_rows == L.UPCAST_MIN_ROWS


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this torch/CPU has no oneDNN bf16 path at all")
def test_linear_upcasts_from_the_measured_row_count(decide):
    decide(True, False, probe=(2.0, 1.5, 0.05))                  # from 26 rows
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=g).bfloat16()           # too big for the dense kernel
    for rows, upcast in ((25, False), (26, True), (200, True)):
        x = torch.randn(rows, 512, generator=g).bfloat16()
        want = F.linear(x.float(), w.float()).bfloat16() if upcast else F.linear(x, w)
        assert torch.equal(L.linear(x, w), want), rows


def test_the_probe_times_both_precisions_and_the_upcast():
    half, fp32, upcast = L._probe()
    assert 0 < half < 5 and 0 < fp32 < 5 and 0 < upcast < 5
    assert torch.get_num_threads() >= 1


def test_auto_computes_in_fp32_without_native_bf16(decide):
    # AVX2-only, or AVX-512 without BF16 (Skylake-SP): oneDNN would emulate bf16
    choice = decide(False, False)
    assert not choice.native and "no AVX512-BF16 or AMX" in choice.reason
    assert L.upcasts(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_env_overrides_the_cpu(decide):
    assert decide(True, True, "fp32").native is False
    assert decide(False, False, "native").native is True
    assert "KVRELAY_CPU_HALF_MATMUL=native" in L.half_matmul_choice().reason


def test_decided_and_logged_once_at_construction(decide, caplog):
    decide(False, False)
    L.cpu_half_matmul_in_fp32.cache_clear()
    from kvrelay.model.parallel import ParallelContext
    with caplog.at_level(logging.INFO, logger="kvrelay.model.layers.linear"):
        layer = L.RowParallelLinear(32, 16, ParallelContext(), torch.bfloat16)
        L.RowParallelLinear(16, 32, ParallelContext(), torch.bfloat16)
        layer(torch.randn(8, 32).bfloat16())
    lines = [r.getMessage() for r in caplog.records if "half-precision matmuls" in r.getMessage()]
    assert lines == ["CPU half-precision matmuls: fp32 compute (no AVX512-BF16 or AMX on this CPU)"]
