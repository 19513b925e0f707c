"""make_transport: the requested backend, or a logged, counted fallback."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from kvrelay.disagg import make_transport
from kvrelay.disagg.nixl import NixlTransport, nixl_import_error, plugin_load_error
from kvrelay.disagg.tcp import TcpTransport
from kvrelay.disagg.transport import TransportUnavailable
from tests.disagg.conftest import needs_nixl


@pytest.fixture
def no_nixl(monkeypatch):
    """Make `import nixl` fail as if it were not installed."""
    for name in [m for m in sys.modules if m == "nixl" or m.startswith("nixl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)


def test_tcp_requested():
    t = make_transport(["TCP"])
    try:
        assert isinstance(t, TcpTransport) and t.name == "tcp" and t.fallback_from is None
    finally:
        t.close()
    with pytest.raises(ValueError, match="TCP cannot be combined"):
        make_transport(["UCX", "TCP"])


def test_without_nixl_falls_back_to_tcp(no_nixl, caplog):
    assert nixl_import_error() is not None
    with pytest.raises(TransportUnavailable, match="NIXL is not installed"):
        NixlTransport("x")
    with caplog.at_level(logging.WARNING, logger="kvrelay.disagg.transport"):
        t = make_transport(["UCX"])
    try:
        assert isinstance(t, TcpTransport) and t.fallback_from == "UCX"
        t.register([torch.zeros(8)])
        assert t.metadata()["transport"] == "tcp"
    finally:
        t.close()
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning and "NIXL is not installed" in warning[0].getMessage()
    assert "UCX" in warning[0].getMessage() and "TCP" in warning[0].getMessage()


@needs_nixl
def test_ucx_requested():
    t = make_transport(["ucx"], agent_name="mt-ucx")
    try:
        assert isinstance(t, NixlTransport) and t.backends == ["UCX"] and t.fallback_from is None
        t.register([torch.zeros(8)])
        md = t.metadata()
        assert md["transport"] == "nixl" and md["agent_name"] == "mt-ucx"
        assert isinstance(md["agent_metadata"], str)             # base64: JSON-able
    finally:
        t.close()


@needs_nixl
def test_libfabric_unavailable_falls_back_to_ucx(caplog):
    reason = plugin_load_error("LIBFABRIC")
    if reason is None:
        pytest.skip("NIXL's LIBFABRIC plugin loads on this machine")
    with caplog.at_level(logging.WARNING, logger="kvrelay.disagg.transport"):
        t = make_transport(["LIBFABRIC"], agent_name="mt-lf")
    try:
        assert isinstance(t, NixlTransport) and t.backends == ["UCX"]
        assert t.fallback_from == "LIBFABRIC"
    finally:
        t.close()
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "LIBFABRIC" in msg and "UCX" in msg and reason in msg


@needs_nixl
def test_unknown_backend_reports_why():
    with pytest.raises(TransportUnavailable, match="NOSUCH"):
        NixlTransport("mt-bad", backends=["NOSUCH"])


@needs_nixl
def test_partial_backend_list_counts_the_missing_one():
    if plugin_load_error("LIBFABRIC") is None:
        pytest.skip("NIXL's LIBFABRIC plugin loads on this machine")
    t = make_transport(["LIBFABRIC", "UCX"], agent_name="mt-both")
    try:
        assert t.backends == ["UCX"] and t.fallback_from == "LIBFABRIC"
    finally:
        t.close()


@needs_nixl
def test_nixl_import_keeps_logging_sane():
    assert nixl_import_error() is None
    assert logging.raiseExceptions is True                  # NIXL's import sets it False
    assert logging.getLogger("nixl").getEffectiveLevel() >= logging.WARNING
