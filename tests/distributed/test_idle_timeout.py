"""Regression: a TP worker waits for the next step inside a gloo broadcast, which the
process group's timeout bounds; at 600 s an idle TP server lost its workers after 10
minutes (reproduced with a 3 s timeout: the waiting rank fails with "Timed out waiting")."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch.distributed as dist

from kvrelay.distributed import tp_workers


class _Joined(Exception):
    pass


def test_tp_group_outlives_idle_periods(monkeypatch):
    """The group a worker rank joins is created with a timeout of days, not minutes."""
    seen: dict = {}

    def joining(*args, **kwargs):
        seen.update(kwargs)
        raise _Joined                                   # stop before loading a model

    monkeypatch.setattr(dist, "init_process_group", joining)
    spec = tp_workers.RankSpec(**{f.name: None for f in dataclasses.fields(tp_workers.RankSpec)})
    spec = dataclasses.replace(spec, tp_size=2, init_method="tcp://127.0.0.1:1", cpu_slices=())
    with pytest.raises(_Joined):
        tp_workers._setup_rank(spec, 1)
    assert seen["world_size"] == 2 and seen["rank"] == 1
    assert seen["timeout"] >= timedelta(days=7)
