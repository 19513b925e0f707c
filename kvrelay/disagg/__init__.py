"""Disaggregated prefill/decode: KV transports (NIXL, TCP) and the side channel.

`transport.py` defines the `KVTransport` API; `nixl.py` and `tcp.py` implement it;
`backends.py` picks one (`make_transport`); `side_channel.py` is the handshake service;
`params.py` the `kv_transfer_params` / `--kv-transfer-config` dataclasses.

Importing this package loads nothing else: the scheduler and the API process read
`disagg.params` without torch, sockets or NIXL. The names below load their module on
first use (`from kvrelay.disagg import make_transport`).
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "KVTransport": "transport", "ReadDesc": "transport", "ReadHandle": "transport",
    "Region": "transport", "TransferError": "transport", "TransportUnavailable": "transport",
    "make_transport": "backends", "NixlTransport": "nixl", "TcpTransport": "tcp",
    "SideChannelClient": "side_channel", "SideChannelError": "side_channel",
    "SideChannelServer": "side_channel", "advertised_host": "side_channel",
    "side_channel_call": "side_channel",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
