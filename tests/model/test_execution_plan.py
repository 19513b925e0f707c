"""Issue 31: one ExecutionPlan, built deterministically from CPU features and config; its
numerics in the KV-cache spec, so a prefill and a decode that compute differently refuse
to pair."""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from kvrelay.kv_cache.spec import KVCacheSpec
from kvrelay.model import execution_plan
from kvrelay.model.execution_plan import (
    UPCAST_MIN_ROWS,
    CpuFeatures,
    ExecutionPlan,
    KernelFacts,
    PlanConfig,
)

AVX2 = CpuFeatures(avx2=True, onednn_bf16=True)
ZEN4 = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, onednn_bf16=True)
SAPPHIRE = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx=True, onednn_bf16=True)
BUILT = KernelFacts(True, False, "avx512", "avx512_bf16", True)


def build(cpu: CpuFeatures = SAPPHIRE, kernels: KernelFacts = BUILT, **config) -> ExecutionPlan:
    return ExecutionPlan.build(cpu, kernels, PlanConfig(**config))


@pytest.mark.parametrize("cpu, matmul", [(AVX2, "fp32"), (ZEN4, "fp32"), (SAPPHIRE, "native"),
                                         (dataclasses.replace(SAPPHIRE, onednn_bf16=False),
                                          "fp32")])
def test_matmul_precision_is_a_function_of_cpu_features(cpu, matmul):
    plan = build(cpu)
    assert plan.matmul == matmul and plan.upcast_min_rows == UPCAST_MIN_ROWS
    # the same facts and config give the same plan: nothing is timed
    assert build(cpu) == plan
    # the kernels' state never changes the numerics
    assert build(cpu, KernelFacts(building=True)).numerics("bfloat16") == plan.numerics("bfloat16")


def test_config_overrides_the_cpu():
    assert build(AVX2, half_matmul="native").matmul == "native"
    assert build(SAPPHIRE, half_matmul="fp32").matmul == "fp32"
    assert "KVRELAY_CPU_HALF_MATMUL=fp32" in build(half_matmul="fp32").matmul_reason


def test_every_choice_is_named_with_the_kernels_built():
    plan = build()
    assert (plan.attention, plan.fresh_prefill, plan.dense, plan.moe) == (
        "native", True, "avx512_bf16", "auto")
    assert plan.moe_tiles and plan.fused_decode and plan.decode_stack and plan.moe_native
    off = build(attention="reference", dense="torch", moe="torch")
    assert (off.attention, off.fresh_prefill, off.dense, off.moe_native) == (
        "reference", False, None, False)
    assert not (off.fused_decode or off.decode_stack or off.moe_tiles)


def test_without_kernels_every_path_is_the_reference_but_fresh_prefill():
    plan = build(kernels=KernelFacts(building=True))
    assert (plan.attention, plan.dense, plan.moe_native, plan.fused_decode) == (
        "reference", None, False, False)
    assert plan.fresh_prefill            # SDPA in pieces needs no kernel
    with pytest.raises(RuntimeError, match="KVRELAY_MOE_KERNEL=native"):
        build(kernels=KernelFacts(), moe="native")


def test_the_plan_reads_the_environment(monkeypatch):
    monkeypatch.setenv("KVRELAY_CPU_HALF_MATMUL", "native")
    monkeypatch.setenv("KVRELAY_ATTENTION_KERNEL", "reference")
    monkeypatch.setenv("KVRELAY_COMPILE_DECODE", "4, 1,2")
    assert PlanConfig.from_env() == PlanConfig("native", "reference", "auto", "auto", (1, 2, 4))
    monkeypatch.setenv("KVRELAY_DENSE_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVRELAY_DENSE_KERNEL: expected auto or torch"):
        PlanConfig.from_env()
    monkeypatch.setenv("KVRELAY_DENSE_KERNEL", "auto")
    monkeypatch.setenv("KVRELAY_COMPILE_DECODE", "one")
    with pytest.raises(ValueError, match="KVRELAY_COMPILE_DECODE"):
        PlanConfig.from_env()


def test_the_process_plan_is_built_and_logged_once(caplog):
    execution_plan.current.cache_clear()
    with caplog.at_level(logging.INFO, logger="kvrelay.model.execution_plan"):
        first = execution_plan.current()
        assert execution_plan.current() is first
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert len(lines) == 1 and f"half matmuls {first.matmul}" in lines[0]


def test_the_reference_plan_and_opting_out():
    ref = ExecutionPlan.reference()
    assert (ref.attention, ref.dense, ref.moe, ref.fused_decode, ref.decode_stack) == (
        "reference", None, "torch", False, False)
    assert not ref.native_kernels and ref.matmul == "fp32"
    layers = dataclasses.replace(build(), decode_stack=False)
    assert layers.fused_decode and not layers.decode_stack
    with pytest.raises(ValueError, match="decode_stack needs fused_decode"):
        dataclasses.replace(build(), fused_decode=False)
    assert build().without_native().numerics("bfloat16") == build().numerics("bfloat16")


def test_numerics_name_what_changes_the_kv_bytes():
    native, fp32 = build(half_matmul="native"), build(half_matmul="fp32")
    assert native.numerics("bfloat16") == "kv=bfloat16;matmul=native-bfloat16"
    assert fp32.numerics("torch.bfloat16") == "kv=bfloat16;matmul=fp32-from-4-rows"
    # a float32 model computes in float32 whatever the half-precision setting
    assert native.numerics("float32") == fp32.numerics("float32") == "kv=float32;matmul=float32"


# -- the handshake refuses a prefill and a decode whose numerics differ --------------------
def _spec(numerics: str) -> KVCacheSpec:
    return KVCacheSpec("tiny:abc", "bfloat16", 4, 2, 2, 8, hybrid=False, sliding_window=None,
                       numerics=numerics)


def test_a_prefill_and_decode_with_other_numerics_refuse_to_pair(caplog):
    """Both sides of the side-channel handshake name the numerics that differ."""
    from kvrelay.disagg.handshake import Engine, HandshakeError, accept, answer, hello

    prefill = Engine("P", _spec(build(half_matmul="native").numerics("bfloat16")), 1)
    decode = Engine("D", _spec(build(half_matmul="fp32").numerics("bfloat16")), 1)
    want = ("numerics: prefill 'kv=bfloat16;matmul=native-bfloat16', "
            "decode 'kv=bfloat16;matmul=fp32-from-4-rows'")
    reply = answer(prefill, 4, [{}], hello(decode))
    assert not reply["ok"] and want in reply["error"]
    # a prefill that (wrongly) accepted: the decode refuses on its side too
    agreeing = answer(dataclasses.replace(prefill, spec=decode.spec), 4, [{}], hello(decode))
    assert agreeing["ok"]
    with pytest.raises(HandshakeError, match=re.escape(want)):
        accept(decode, "P", "127.0.0.1", 1, {**agreeing, "spec": prefill.spec.__dict__})
    # the same numerics pair
    assert answer(prefill, 4, [{}], hello(dataclasses.replace(decode, spec=prefill.spec)))["ok"]


def test_the_spec_differences_name_the_numerics():
    a, b = _spec("kv=bfloat16;matmul=native-bfloat16"), _spec("kv=bfloat16;matmul=fp32-from-4-rows")
    assert a.differences(b) == ["numerics: 'kv=bfloat16;matmul=native-bfloat16' vs "
                                "'kv=bfloat16;matmul=fp32-from-4-rows'"]
    assert a.compat_hash() != b.compat_hash()
