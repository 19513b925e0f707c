"""The execution plan: every fast-path choice of the model, named once per process.

    CpuFeatures.detect()   the running CPU (torch's cpuinfo; never the build machine's), as
                           KVRELAY_CPU_ISA caps it (kernels/isa.py)
    KernelFacts.detect()   what the native kernels package loaded (`kernels.status()`)
    PlanConfig.from_env()  the KVRELAY_* kernel variables (envs.py), validated
            │
            ▼  ExecutionPlan.build(cpu, kernels, config): a pure function, no timing
    ExecutionPlan          frozen; logged once (one INFO line); handed to the model at
                           construction (`GptOssModel(plan=...)`), which hands it to its layers

What the plan decides, and the one rule for each:

    matmul           bf16/fp16 GEMMs: "native" (torch's half GEMM, oneDNN) or "fp32" (weights
                     upcast per matmul, results rounded back). KVRELAY_CPU_HALF_MATMUL=native
                     or fp32 wins; "auto" is native exactly where the CPU has AMX tiles and
                     oneDNN a bf16 path, fp32 everywhere else (AVX2 and AVX-512 without BF16
                     emulate bf16; an AVX512-BF16 CPU without AMX measured its bf16 GEMM
                     slower than fp32 compute: 115-137 against 205-216 GFLOP/s on a Xeon,
                     145 against 192 on a Zen 4). A function of CPU features and config
                     only, so two servers on the same CPU kind and config compute the same
                     numerics whatever their load; `linear.measure_half_matmul` may time the
                     two precisions to *suggest* a setting, never to decide one.
    upcast_min_rows  fp32 compute: the fewest rows a half matmul is upcast from (fewer keep
                     the half kernel, which streams 2-byte weights): UPCAST_MIN_ROWS.
    attention        "native" (the C++ paged decode / fresh prefill kernels) or "reference"
                     (KVRELAY_ATTENTION_KERNEL=reference, or no kernels); `fresh_prefill`:
                     fresh prompts attend their own k/v (off only with =reference).
    dense            the dense kernels' ISA for decode-sized matmuls and norms, or None
                     (KVRELAY_DENSE_KERNEL=torch, no kernels, or only their generic build).
    moe              KVRELAY_MOE_KERNEL: "auto" (the kernel, torch's GEMMs past the row
                     thresholds of layers/moe.py), "native" or "torch"; `moe_tiles`: the
                     AVX512-BF16 tiles may take many rows per expert (auto only).
    fused_decode     decode-only steps take the layers' fused ops (`FusedDecode`, native attention)
    decode_stack     and all layers as one native call where every layer's ops are native.
    compiled_decode  KVRELAY_COMPILE_DECODE's batch sizes (the runner compiles them).
    screened_head    greedy steps take the LM head's tokens from its int8 copy, screened
                     (layers/screened.py: the same tokens, half the bytes) wherever the dense
                     kernels run; KVRELAY_SCREENED_HEAD=off keeps the exact head alone.

    KVRELAY_CPU_ISA  caps the kernels' ISA (kernels/isa.py: every family's variant, in C++ and
                     here) and the CPU features the rules above read: a cap below AVX-512
                     hides AVX-512, AVX512-BF16 and AMX from `matmul`, so a forced run makes
                     the choices a CPU of that ISA would. `cpu.hardware_isa` is the CPU's own
                     best, `cpu.forced_isa` the cap (None: native).

`numerics(dtype)` is the part that changes the KV bytes a step writes (KV dtype, matmul
precision); it goes into the KV-cache spec prefill and decode compare at their handshake.
The kernels' ISA is not part of it, forced or not: the native kernels are not the reference
paths' bits either (a server switches to them mid-run, `engine/native_switch.py`, with its
numerics unchanged), and servers on different CPU kinds pair; what a cap changes in the
numerics it changes through `matmul`.
Tests and profilers opt out through the plan (`ExecutionPlan.reference()`,
`dataclasses.replace(plan, decode_stack=False)` then `model.use_plan(plan)`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Literal

from kvrelay import envs
from kvrelay.model.kernels import isa

logger = logging.getLogger(__name__)

Matmul = Literal["native", "fp32"]
Attention = Literal["native", "reference"]
MoeMode = Literal["auto", "native", "torch"]

MATMUL_MODES = ("auto", "native", "fp32")
ATTENTION_MODES = ("auto", "reference")
DENSE_MODES = ("auto", "torch")
MOE_MODES = ("auto", "native", "torch")
SCREENED_HEAD_MODES = ("auto", "off")
# The dense kernels' ISA variants that are dispatch targets (linear.DENSE_MAX_ROWS has a row
# limit for each); the generic build is a tested fallback only.
DENSE_ISAS = ("avx512_bf16", "avx512", "avx2")
# Below this many rows a half matmul streams its weights (GEMV-like) and torch's half kernel,
# reading 2 bytes per weight, beats upcasting them (≈10 bytes of traffic per weight): at 1 row
# the upcast is 2.6–3× slower, from ~4 rows on it wins (2× at 8, 7× at 64).
UPCAST_MIN_ROWS = 4


@dataclass(frozen=True)
class CpuFeatures:
    """The running CPU's features that a choice depends on, as KVRELAY_CPU_ISA caps them."""

    avx2: bool = False
    avx512: bool = False
    avx512_bf16: bool = False
    amx: bool = False
    onednn_bf16: bool = False     # torch's oneDNN has a bf16 GEMM here
    hardware_isa: str = "generic"     # the table's best variant this CPU runs (kernels/isa.py)
    forced_isa: str | None = None     # KVRELAY_CPU_ISA's cap; None: native

    @classmethod
    def detect(cls) -> CpuFeatures:
        """torch's view of the CPU, each feature kept only where the cap allows it (AMX is in
        no variant: any cap hides it). ValueError for a cap this CPU cannot run."""
        import torch

        forced = isa.cap()
        allowed = isa.cpu_features()

        def has(name: str, needs: frozenset[str] | None) -> bool:
            within = forced is None or (needs is not None and needs <= allowed)
            return within and bool(getattr(torch.cpu, name, lambda: False)())

        onednn = torch.backends.mkldnn.is_available() and bool(
            torch.ops.mkldnn._is_mkldnn_bf16_supported())
        table = isa.ISA_FEATURES
        return cls(has("_is_avx2_supported", table["avx2"]),
                   has("_is_avx512_supported", table["avx512"]),
                   has("_is_avx512_bf16_supported", table["avx512_bf16"]),
                   has("_is_amx_tile_supported", None), onednn,
                   isa.top(isa.hardware_features()), forced)

    def isa_note(self) -> str:
        """The log's words on a cap, e.g. ' (forced by KVRELAY_CPU_ISA; this CPU: avx2)'."""
        if self.forced_isa is None:
            return ""
        return f" (forced by {envs.CPU_ISA.name}; this CPU: {self.hardware_isa})"

    def bf16_names(self) -> tuple[str, ...]:
        """The native-bf16 features present, for messages."""
        return tuple(n for n, on in (("amx", self.amx), ("avx512_bf16", self.avx512_bf16)) if on)


@dataclass(frozen=True)
class KernelFacts:
    """What the native kernels package has loaded in this process."""

    available: bool = False
    building: bool = False        # a background build is still running
    isa: str | None = None
    dense_isa: str | None = None
    moe_tiles: bool = False       # the AVX512-BF16 tile kernel runs here
    reason: str = ""              # why they are not available

    @classmethod
    def detect(cls) -> KernelFacts:
        from kvrelay.model import kernels

        status = kernels.status()
        if not status.available:
            return cls(False, status.building, reason=status.reason)
        import torch

        tiles = bool(torch.ops.kvrelay_kernels.moe_tile_isas())
        return cls(True, False, status.isa, status.dense_isa, tiles)


@dataclass(frozen=True)
class PlanConfig:
    """The explicit configuration the plan reads (KVRELAY_* variables, see envs.py)."""

    half_matmul: str = "auto"
    attention: str = "auto"
    dense: str = "auto"
    moe: str = "auto"
    compiled_decode: tuple[int, ...] = ()
    screened_head: str = "auto"

    def __post_init__(self) -> None:
        for value, allowed, var in ((self.half_matmul, MATMUL_MODES, envs.CPU_HALF_MATMUL),
                                    (self.screened_head, SCREENED_HEAD_MODES,
                                     envs.SCREENED_HEAD),
                                    (self.attention, ATTENTION_MODES, envs.ATTENTION_KERNEL),
                                    (self.dense, DENSE_MODES, envs.DENSE_KERNEL),
                                    (self.moe, MOE_MODES, envs.MOE_KERNEL)):
            if value not in allowed:
                expected = f"{', '.join(allowed[:-1])} or {allowed[-1]}"
                raise ValueError(f"{var.shown}: expected {expected}, got {value!r}")
        if any(size < 1 for size in self.compiled_decode):
            raise ValueError(f"{envs.COMPILE_DECODE.shown}: batch sizes must be positive, got "
                             f"{self.compiled_decode}")

    @classmethod
    def from_env(cls) -> PlanConfig:
        return cls(envs.CPU_HALF_MATMUL.raw() or "auto", envs.ATTENTION_KERNEL.raw() or "auto",
                   envs.DENSE_KERNEL.raw() or "auto", envs.MOE_KERNEL.raw() or "auto",
                   _sizes(envs.COMPILE_DECODE.raw()), envs.SCREENED_HEAD.raw() or "auto")


def _sizes(raw: str | None) -> tuple[int, ...]:
    if not raw:
        return ()
    try:
        return tuple(sorted({int(b) for b in raw.split(",") if b.strip()}))
    except ValueError:
        raise ValueError(f"{envs.COMPILE_DECODE.shown}: expected batch sizes such as "
                         f"'1,2,4,8', got {raw!r}") from None


def matmul_rule(cpu: CpuFeatures, mode: str) -> tuple[Matmul, str]:
    """(the half-precision matmul precision, why): see the module docstring."""
    if mode == "native":
        return "native", f"{envs.CPU_HALF_MATMUL.name}=native"
    if mode == "fp32":
        return "fp32", f"{envs.CPU_HALF_MATMUL.name}=fp32"
    if not cpu.onednn_bf16:
        return "fp32", "oneDNN without bf16 support"
    if cpu.amx:
        return "native", f"this CPU has {'+'.join(cpu.bf16_names())}"
    if cpu.avx512_bf16:
        return "fp32", "AVX512-BF16 without AMX (its bf16 GEMM is slower than fp32 compute)"
    return "fp32", "no AVX512-BF16 or AMX on this CPU"


@dataclass(frozen=True)
class ExecutionPlan:
    """Every fast-path choice of one process's model (see the module docstring)."""

    cpu: CpuFeatures
    kernels: KernelFacts
    matmul: Matmul
    matmul_reason: str
    upcast_min_rows: int
    attention: Attention
    fresh_prefill: bool       # fresh prompts attend their own k/v (native, or SDPA pieces)
    dense: str | None
    moe: MoeMode
    moe_tiles: bool
    fused_decode: bool
    decode_stack: bool
    compiled_decode: tuple[int, ...] = ()
    screened_head: bool = False

    def __post_init__(self) -> None:
        if self.fused_decode and self.attention != "native":
            raise ValueError("fused_decode needs the native attention kernels")
        if self.decode_stack and not self.fused_decode:
            raise ValueError("decode_stack needs fused_decode")

    @classmethod
    def build(cls, cpu: CpuFeatures, kernels: KernelFacts, config: PlanConfig) -> ExecutionPlan:
        """The plan for these facts and this config; deterministic (no timing)."""
        matmul, why = matmul_rule(cpu, config.half_matmul)
        if config.moe == "native" and not (kernels.available or kernels.building):
            raise RuntimeError(f"{envs.MOE_KERNEL.shown}=native but the native kernels could "
                               f"not be built: {kernels.reason}")
        native = kernels.available
        attention: Attention = "native" if native and config.attention == "auto" else "reference"
        dense = (kernels.dense_isa if native and config.dense == "auto"
                 and kernels.dense_isa in DENSE_ISAS else None)
        moe: MoeMode = config.moe  # type: ignore[assignment]  # validated by PlanConfig
        fused = attention == "native"
        return cls(cpu, kernels, matmul, why, UPCAST_MIN_ROWS, attention,
                   config.attention == "auto", dense, moe,
                   moe == "auto" and native and kernels.moe_tiles, fused, fused,
                   config.compiled_decode, dense is not None and config.screened_head == "auto")

    @classmethod
    def detect(cls) -> ExecutionPlan:
        """The plan of this process: the running CPU, the loaded kernels, the environment."""
        return cls.build(CpuFeatures.detect(), KernelFacts.detect(), PlanConfig.from_env())

    @classmethod
    def reference(cls, matmul: Matmul = "fp32") -> ExecutionPlan:
        """Every op on its PyTorch reference path (what the kernels are tested against)."""
        return cls(CpuFeatures(), KernelFacts(), matmul, "the reference plan", UPCAST_MIN_ROWS,
                   "reference", False, None, "torch", False, False, False)

    @property
    def native_kernels(self) -> bool:
        return self.kernels.available

    @property
    def moe_native(self) -> bool:
        """Whether the experts may take the native kernel (the row rules decide per call)."""
        return self.moe != "torch" and self.kernels.available

    @property
    def half_in_fp32(self) -> bool:
        return self.matmul == "fp32"

    def numerics(self, dtype: str) -> str:
        """What decides the KV bytes a step writes, for the KV-cache spec: the model/KV dtype
        and, for a half-precision model, the matmul precision (a float32 model has one)."""
        dtype = dtype.removeprefix("torch.")
        if dtype not in ("bfloat16", "float16"):
            return f"kv={dtype};matmul={dtype}"
        if self.matmul == "native":
            return f"kv={dtype};matmul=native-{dtype}"
        return f"kv={dtype};matmul=fp32-from-{self.upcast_min_rows}-rows"

    def describe(self) -> str:
        """One line for the log."""
        kernels = ("ready, ISA " + str(self.kernels.isa) if self.kernels.available
                   else "building" if self.kernels.building else "unavailable")
        if self.cpu.forced_isa is not None and not self.kernels.available:
            kernels += f", ISA {self.cpu.forced_isa}"
        kernels += self.cpu.isa_note()
        return (f"half matmuls {self.matmul} ({self.matmul_reason}); kernels {kernels}; "
                f"attention {self.attention}; dense {self.dense or 'torch'}; moe {self.moe}"
                f"{' + bf16 tiles' if self.moe_tiles else ''}; decode "
                f"{'stack' if self.decode_stack else 'fused' if self.fused_decode else 'layers'}"
                f"; compiled decode {list(self.compiled_decode) or 'off'}"
                f"; greedy head {'screened' if self.screened_head else 'exact'}")

    def without_native(self) -> ExecutionPlan:
        """This plan with every native kernel off (numerics unchanged)."""
        return dataclasses.replace(self, kernels=KernelFacts(), attention="reference",
                                   dense=None, moe_tiles=False, fused_decode=False,
                                   decode_stack=False, screened_head=False)


@functools.cache
def current() -> ExecutionPlan:
    """This process's plan, built and logged once (`engine/native_switch.py` clears it when
    the kernels' availability changes, and hands the new one to the model)."""
    plan = ExecutionPlan.detect()
    logger.info("execution plan: %s", plan.describe())
    return plan
