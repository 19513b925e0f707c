from __future__ import annotations

import os

import pytest

from kvrelay.disagg.nixl import nixl_import_error

HAVE_NIXL = nixl_import_error() is None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason=f"NIXL not installed ({nixl_import_error()})")


@pytest.fixture(scope="module", autouse=True)
def _ucx_loopback_only():
    """UCX would also open eth0; tests stay on loopback (set before any agent starts, and
    inherited by spawned producer processes)."""
    old = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = "lo"
    yield
    if old is None:
        os.environ.pop("UCX_NET_DEVICES", None)
    else:
        os.environ["UCX_NET_DEVICES"] = old
