"""Regression: a TP worker waits for the next step inside a gloo broadcast, which the
process group's timeout bounds; at 600 s an idle TP server lost its workers after 10
minutes (reproduced with a 3 s timeout: the waiting rank fails with "Timed out waiting")."""
from __future__ import annotations

from datetime import timedelta

from kvrelay.distributed.executor import IDLE_SAFE_TIMEOUT


def test_tp_group_outlives_idle_periods():
    assert IDLE_SAFE_TIMEOUT >= timedelta(days=7)
