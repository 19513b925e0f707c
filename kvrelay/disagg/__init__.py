"""Disaggregated prefill/decode: KV transports (NIXL, TCP) and the side channel.

`transport.py` defines the `KVTransport` API and `make_transport`; `nixl.py` and
`tcp.py` implement it; `side_channel.py` is the handshake service. NIXL is optional:
nothing here imports it until a `NixlTransport` is made.
"""
from kvrelay.disagg.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    advertised_host,
    side_channel_call,
)
from kvrelay.disagg.transport import (
    KVTransport,
    ReadDesc,
    ReadHandle,
    Region,
    TransferError,
    TransportUnavailable,
    make_transport,
)

__all__ = [
    "KVTransport", "ReadDesc", "ReadHandle", "Region", "TransferError", "TransportUnavailable",
    "make_transport", "SideChannelClient", "SideChannelError", "SideChannelServer",
    "advertised_host", "side_channel_call", "NixlTransport", "TcpTransport",
]


def __getattr__(name: str):
    if name == "NixlTransport":
        from kvrelay.disagg.nixl import NixlTransport
        return NixlTransport
    if name == "TcpTransport":
        from kvrelay.disagg.tcp import TcpTransport
        return TcpTransport
    raise AttributeError(name)
