"""The one ISA dispatch table (kernels/isa.py) and the C++ that must follow it: the compile
targets (csrc/isa.h), the runtime check (csrc/isa_dispatch.h), each family's list of
variants, the sources' naming convention and the SIMD helpers defined once."""
from __future__ import annotations

import re

import pytest
import torch

from kvrelay.model import kernels
from kvrelay.model.kernels import isa

CSRC = isa.CSRC
GCC_NAMES = {"avx512bf16": "avx512_bf16"}      # GCC's spelling -> Linux's (isa.py's)


def _gcc_features(text: str) -> frozenset[str]:
    return frozenset(GCC_NAMES.get(f, f) for f in text.split(","))


def test_the_compile_targets_are_the_table():
    header = (CSRC / "isa.h").read_text().replace("\\\n", "")
    targets = {m.group(1).lower(): "".join(re.findall(r'"([^"]*)"', m.group(2)))
               for m in re.finditer(r"#define KVRELAY_ISA_(\w+)\s+(.*)", header)}
    assert {name: _gcc_features(t) for name, t in targets.items()} == {
        name: features for name, features in isa.ISA_FEATURES.items() if name != "generic"}


def test_the_runtime_check_tests_every_feature_of_the_table():
    dispatch = (CSRC / "isa_dispatch.h").read_text()
    checked = {GCC_NAMES.get(f, f) for f in re.findall(r'__builtin_cpu_supports\("(\w+)"\)',
                                                       dispatch)}
    assert checked == set().union(*isa.ISA_FEATURES.values())


def test_no_source_decides_the_isa_on_its_own():
    """One runtime check (isa_dispatch.h) and one target list (isa.h) for every family."""
    for path in sorted(CSRC.iterdir()):
        if path.name in ("isa.h", "isa_dispatch.h"):
            continue
        text = path.read_text()
        assert "__builtin_cpu_supports" not in text, path.name
        assert not re.search(r'target\("[^"]*avx', text), path.name


def test_simd_helpers_are_defined_once():
    """bf16 widening and e^x live in the simd_*.h headers only."""
    defined = {"bf16 widening": r"slli_epi32\(_mm\d*_cvtepu16_epi32",
               "scalar bf16": r"uint32_t\(\w+(\[\w+\])?\) << 16",
               "exp_neg": r"inline \w+ exp_neg\w*\("}
    for what, pattern in defined.items():
        owners = {p.name for p in CSRC.iterdir() if re.search(pattern, p.read_text())}
        assert owners and owners <= {"simd_generic.h", "simd_avx2.h", "simd_avx512.h"}, what


def test_sources_follow_the_naming_convention():
    names = isa.sources()
    assert names == tuple(sorted(p.name for p in CSRC.glob("*.cpp")))
    for name in names:
        family, kind = isa.source_kind(name)
        if kind != "op" and family in isa.FAMILIES:
            assert kind in isa.FAMILIES[family].variants, name
    for group in isa.FAMILIES.values():
        builds = {isa.source_kind(n)[1] for n in names if isa.source_kind(n)[0] == group.name}
        assert builds, f"no source for the {group.name} family"
    with pytest.raises(ValueError, match=r"named <family>_op\.cpp"):
        isa.source_kind("moe_sse3.cpp")


def test_a_cpu_without_a_feature_runs_no_variant_that_needs_it():
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c", "popcnt"})
    assert isa.variants("moe", avx2_only) == ("avx2", "generic")
    assert isa.variants("moe_tile", avx2_only) == ()
    # AVX-512 without DQ is no "avx512" in any family
    no_dq = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    assert all("avx512" not in isa.variants(f, no_dq) for f in isa.FAMILIES)
    assert isa.why_not("bitmask", "avx512", no_dq) == (
        "bitmask avx512 build: this CPU lacks avx512dq")
    assert isa.why_not("moe", "avx2", avx2_only) == ""
    assert isa.best("dense", frozenset()) == "generic"
    line = isa.report(avx2_only)
    assert line.startswith("kernel ISA builds run: generic, avx2; not on this CPU: avx512 (lacks")
    assert "families with no build here: moe_tile" in line


def test_every_family_lists_what_the_table_picks_for_this_cpu():
    """The C++ lists (what `isa=""` chooses from, best first) are the table's."""
    status = kernels.status()
    if not status.available:
        pytest.skip(f"the native kernels cannot be built here: {status.reason}")
    for family in isa.FAMILIES.values():
        built = tuple(getattr(torch.ops.kvrelay_kernels, family.list_op)())
        assert built == isa.variants(family.name), family.name
    assert status.isas == isa.variants("moe") and status.dense_isa == isa.best("dense")


def test_an_isa_the_cpu_lacks_is_refused_by_name():
    if not kernels.status().available:
        pytest.skip("the native kernels cannot be built here")
    lacking = [v for v in isa.FAMILIES["argmax"].variants if not isa.runs(v)]
    if not lacking:
        pytest.skip("this CPU runs every argmax build")
    with pytest.raises(RuntimeError, match=f"argmax_rows: ISA '{lacking[0]}' is not supported"):
        torch.ops.kvrelay_kernels.argmax_rows(torch.zeros(1, 8), lacking[0])
