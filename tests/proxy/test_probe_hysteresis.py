"""The background /health probe: a loaded server that misses one probe's deadline keeps its
place (and its prefix-cache entries); a second timeout in a row, a refusal or a non-200
answer marks it unhealthy at once."""
from __future__ import annotations

import asyncio

import pytest

from kvrelay.proxy import state as proxy_state


@pytest.fixture()
def state():
    return proxy_state.ProxyState.create([("127.0.0.1", 1)], [("127.0.0.1", 2)],
                                         health_interval_s=0)


def _check_with(state, monkeypatch, reason: str | None) -> bool:
    async def probe(_state, _backend):
        return reason
    async def no_scrape(_backend):
        return None
    monkeypatch.setattr(proxy_state, "probe", probe)
    monkeypatch.setattr(state, "_scrape", no_scrape)
    b = state.prefill[0]
    asyncio.run(state._check(b))
    return b.healthy


def test_one_timeout_keeps_a_backend_healthy_two_do_not(state, monkeypatch):
    assert _check_with(state, monkeypatch, proxy_state.TIMED_OUT)
    assert not _check_with(state, monkeypatch, proxy_state.TIMED_OUT)
    assert _check_with(state, monkeypatch, None)                      # answers again
    assert _check_with(state, monkeypatch, proxy_state.TIMED_OUT)      # the count starts over


@pytest.mark.parametrize("reason", ["HTTP 503", "connection refused"])
def test_a_refusal_or_an_error_status_counts_at_once(state, monkeypatch, reason):
    assert not _check_with(state, monkeypatch, reason)
