"""The CPU features this process runs on and the ISA dispatch table of the native kernels.

One table for every kernel family: a variant name means the same instruction sets
everywhere, and a family lists its variants best first.

    variant        needs (Linux /proc/cpuinfo flag names)
    generic        nothing (the compiler's baseline vectors)
    avx2           avx2 fma f16c popcnt
    avx512         avx2's + avx512f avx512bw avx512dq avx512vl
    avx512_bf16    avx512's + avx512_bf16

The C++ side holds the same sets twice, both checked against this table by
tests/model/test_kernel_isa.py: the compile targets (csrc/isa.h) and the one runtime check
every `*_op.cpp` picks its variants with (csrc/isa_dispatch.h `cpu_runs`). Sources follow
the naming convention `<family>_op.cpp` (the torch op, generic code) and
`<family>_<variant>.cpp` (one variant's build); `sources()` finds them.

KVRELAY_CPU_ISA caps the table (generic < avx2 < avx512 < avx512_bf16), so that a lesser
CPU's kernels can be measured on this one: `cpu_features()` is then the CPU's features
within the capped variant's, every family's `variants`/`best` follow, and the C++ rule
(`cpu_runs`) reads the same variable, so every op's default ("" isa) is the capped best.
`hardware_features()` stays the CPU's own. A cap this CPU cannot run is a ValueError
(`cap()`), never a silent downgrade.

Imports no torch: the execution plan and the test log read the CPU from here.
"""
from __future__ import annotations

import functools
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvrelay import envs

CSRC = Path(__file__).parent / "csrc"

# the flags `hardware_features()` reports (others in /proc/cpuinfo are of no use to the kernels)
KNOWN_FEATURES = ("sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "avx512f",
                  "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni",
                  "amx_tile", "amx_bf16", "amx_int8")

_AVX2 = frozenset({"avx2", "fma", "f16c", "popcnt"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}

# variant -> the CPU features it needs
ISA_FEATURES: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
}


@dataclass(frozen=True)
class Family:
    """A kernel family: its variants (best first) and the op that lists the built ones."""

    name: str                       # the sources' prefix
    variants: tuple[str, ...]
    list_op: str                    # torch.ops.kvrelay_kernels.<list_op>() -> the usable ones
    ops: tuple[str, ...]            # the torch ops that take its `isa`


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("moe", ("avx512_bf16", "avx512", "avx2", "generic"), "isas",
           ("moe_experts", "moe_route_experts")),
    # the decode builds ride on the MoE list (moe.h IsaKernels::decode)
    Family("paged_decode", ("avx512_bf16", "avx512", "avx2", "generic"), "isas",
           ("paged_decode", "rotary_decode_attention")),
    Family("dense", ("avx512_bf16", "avx512", "avx2", "generic"), "dense_isas",
           ("dense_linear",)),
    Family("prefill", ("avx512", "avx2", "generic"), "prefill_isas", ("prefill_attention",)),
    Family("argmax", ("avx512", "avx2", "generic"), "argmax_isas", ("argmax_rows",)),
    Family("bitmask", ("avx512", "avx2", "generic"), "grammar_isas",
           ("grammar_rows", "topk_rows")),
    # the screened greedy LM head (layers/screened.py): int16 pair products
    Family("screen", ("avx512", "avx2", "generic"), "screen_isas",
           ("screen_argmax", "screen_bounds")),
    # bf16 pair products only: no fallback build (layers/moe_tiles.py keeps moe_experts)
    Family("moe_tile", ("avx512_bf16",), "moe_tile_isas", ("moe_tiles",)),
)}


# KVRELAY_CPU_ISA's values: no cap, or a variant (ISA_FEATURES lists them worst first)
CAP_VALUES = ("native", *ISA_FEATURES)


@functools.cache
def hardware_features() -> frozenset[str]:
    """The KNOWN_FEATURES this CPU has (Linux: the kernel's flags, which it clears where the
    OS does not save the registers); empty where they cannot be read (the generic builds)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "i686"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return frozenset(f for f in KNOWN_FEATURES if f in flags)


def top(features: frozenset[str]) -> str:
    """The best variant of the table that a CPU with `features` runs ("generic" at least)."""
    return next(v for v in reversed(ISA_FEATURES) if ISA_FEATURES[v] <= features)


def parse_cap(value: str, features: frozenset[str]) -> str | None:
    """The variant KVRELAY_CPU_ISA=`value` caps the kernels at on a CPU with `features`
    (None: "native", no cap). ValueError for an unknown name, or a variant that CPU cannot
    run: emulating a better CPU is not possible, and a silent downgrade would measure
    something else than what was asked."""
    if value == "native":
        return None
    if value not in ISA_FEATURES:
        raise ValueError(f"{envs.CPU_ISA.name}: expected {', '.join(CAP_VALUES[:-1])} or "
                         f"{CAP_VALUES[-1]}, got {value!r}")
    lacking = sorted(ISA_FEATURES[value] - features)
    if lacking:
        raise ValueError(f"{envs.CPU_ISA.name}={value}: this CPU cannot run it (its best is "
                         f"{top(features)}; it lacks {', '.join(lacking)})")
    return value


@functools.cache
def cap() -> str | None:
    """This process's cap (KVRELAY_CPU_ISA), checked against this CPU; None: no cap."""
    return parse_cap(envs.CPU_ISA.raw() or "native", hardware_features())


def cpu_features() -> frozenset[str]:
    """The features this process's kernels may use: the CPU's, within the capped variant's
    where KVRELAY_CPU_ISA caps them (a generic cap: none, as on a CPU whose flags cannot be
    read). ValueError where the cap is unknown or above this CPU."""
    limit = cap()
    features = hardware_features()
    return features if limit is None else features & ISA_FEATURES[limit]


def missing(isa: str, features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The features `isa` needs that the CPU (or `features`) lacks, sorted."""
    have = cpu_features() if features is None else features
    return tuple(sorted(ISA_FEATURES[isa] - have))


def runs(isa: str, features: frozenset[str] | None = None) -> bool:
    return not missing(isa, features)


def variants(family: str, features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The variants of `family` this CPU runs, best first (what its C++ list op answers)."""
    return tuple(v for v in FAMILIES[family].variants if runs(v, features))


def best(family: str, features: frozenset[str] | None = None) -> str | None:
    """The variant the family's ops take by default ("" isa); None where none runs."""
    usable = variants(family, features)
    return usable[0] if usable else None


def why_not(family: str, isa: str, features: frozenset[str] | None = None) -> str:
    """Why this CPU cannot run `family`'s `isa` build ("" when it can): the message a
    skipped test gives."""
    if isa not in FAMILIES[family].variants:
        return f"{family} has no {isa} build"
    hardware = hardware_features() if features is None else features
    if not runs(isa, features) and runs(isa, hardware):
        return f"{family} {isa} build: above {envs.CPU_ISA.name}={cap()}"
    lacking = missing(isa, hardware)
    return f"{family} {isa} build: this CPU lacks {', '.join(lacking)}" if lacking else ""


def report(features: frozenset[str] | None = None) -> str:
    """One line: the variants run here, those above KVRELAY_CPU_ISA's cap (this process's
    report only) and those this CPU cannot run, with what it lacks."""
    names = sorted({v for f in FAMILIES.values() for v in f.variants},
                   key=list(ISA_FEATURES).index)
    hardware = hardware_features() if features is None else features
    ran = [v for v in names if runs(v, features)]
    capped = [v for v in names if runs(v, hardware) and not runs(v, features)]
    skipped = [f"{v} (lacks {' '.join(missing(v, hardware))})" for v in names
               if not runs(v, hardware)]
    families = [f.name for f in FAMILIES.values() if not variants(f.name, features)]
    line = f"kernel ISA builds run: {', '.join(ran) or 'none'}"
    if capped:
        line += f"; above {envs.CPU_ISA.name}={cap()}: {', '.join(capped)}"
    if skipped:
        line += f"; not on this CPU: {', '.join(skipped)}"
    if families:
        line += f"; families with no build here: {', '.join(families)}"
    return line


_SOURCE = re.compile(r"^(?P<family>[a-z0-9_]+?)_(?P<kind>op|" + "|".join(
    sorted(ISA_FEATURES, key=len, reverse=True)) + r")\.cpp$")


def source_kind(name: str) -> tuple[str, str]:
    """(family, "op" or variant) of a source file name; ValueError where the name does not
    follow the convention (a new ISA must be added to ISA_FEATURES first)."""
    match = _SOURCE.match(name)
    if match is None:
        raise ValueError(f"csrc/{name}: a kernel source is named <family>_op.cpp or "
                         f"<family>_<variant>.cpp with a variant of {sorted(ISA_FEATURES)}")
    return match.group("family"), match.group("kind")


def sources(csrc: Path = CSRC) -> tuple[str, ...]:
    """Every C++ source of the extension (sorted names), each checked by `source_kind`."""
    names = tuple(sorted(p.name for p in csrc.glob("*.cpp")))
    for name in names:
        source_kind(name)
    return names
