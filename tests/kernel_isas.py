"""ISA parametrisation of the kernel tests, from the one dispatch table (kernels/isa.py):
every variant of a family, run where this CPU runs it, skipped with the features it lacks
named where it does not — never left out silently."""
from __future__ import annotations

from typing import Any

import pytest

from kvrelay.model.kernels import isa


def isa_params(family: str) -> list[Any]:
    """pytest params over `family`'s variants, best first (ids: the variant names)."""
    params = []
    for variant in isa.FAMILIES[family].variants:
        reason = isa.why_not(family, variant)
        marks = (pytest.mark.skip(reason=reason),) if reason else ()
        params.append(pytest.param(variant, id=variant, marks=marks))
    return params


def skip_unless_runs(family: str, variant: str) -> None:
    """Skip the calling test where this CPU cannot run `family`'s `variant` build."""
    reason = isa.why_not(family, variant)
    if reason:
        pytest.skip(reason)
