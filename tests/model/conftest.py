"""Every model test starts from this process's execution plan as its environment says now
(tests set KVRELAY_* variables before building layers)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.model import execution_plan


@pytest.fixture(autouse=True)
def fresh_execution_plan() -> Iterator[None]:
    execution_plan.current.cache_clear()
    yield
    execution_plan.current.cache_clear()
