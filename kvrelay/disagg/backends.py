"""Which `KVTransport` serves the configured backend names: `make_transport`.

Here, not in `transport.py`, so that the implementations (`nixl.py`, `tcp.py`) import the
transport API without the API importing them back.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from kvrelay.disagg import nixl as nixl_mod
from kvrelay.disagg.tcp import TcpTransport
from kvrelay.disagg.transport import KVTransport, TransportUnavailable

logger = logging.getLogger(__name__)


def make_transport(backends: Sequence[str] | None = None, *, agent_name: str | None = None,
                   backend_options: dict[str, dict[str, str]] | None = None,
                   host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                   serve: bool = True, ucx_host: str | None = None) -> KVTransport:
    """The transport for `backends` (vLLM's `kv_connector_extra_config["backends"]`,
    default ["UCX"]).

    - ["TCP"] → TcpTransport(host, port).
    - NIXL backends (["UCX"], ["LIBFABRIC"], several) → NixlTransport with those whose
      plugins load; if none loads, NIXL UCX; if NIXL is missing or UCX does not load
      either, TcpTransport. Each fallback logs a WARNING naming what was asked for and
      what is used, and sets `.fallback_from` to the requested names not in use
      ("LIBFABRIC", "UCX", "LIBFABRIC,UCX"; None when all are) so the caller can count
      it in a metric.

    `host`/`port` are where a TcpTransport listens (it serves reads to peers unless
    `serve` is False; with a `secret` its peers authenticate first, and it proves itself
    as `agent_name`). `ucx_host`: the
    address whose interface NIXL's UCX may listen on (`NixlTransport`).
    """
    requested = [str(b).upper() for b in (backends or ["UCX"])]
    if not requested:
        requested = ["UCX"]
    asked = ",".join(requested)
    if requested == ["TCP"]:
        return TcpTransport(host=host, port=port, secret=secret, serve=serve,
                            identity=agent_name or "")
    if "TCP" in requested:
        raise ValueError(f"KV transport backends {requested}: TCP cannot be combined with NIXL "
                         f"backends")

    missing = nixl_mod.nixl_import_error()
    if missing is not None:
        logger.warning("KV transfer: NIXL backend %s requested but NIXL is not installed (%s); "
                       "falling back to kvrelay's TCP transport. Install NIXL with `pip install "
                       "nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1`.", asked, missing)
        tcp = TcpTransport(host=host, port=port, secret=secret, serve=serve,
                           identity=agent_name or "")
        tcp.fallback_from = asked
        return tcp

    try:
        nixl = nixl_mod.NixlTransport(agent_name, backends=requested,
                                      backend_options=backend_options, ucx_host=ucx_host)
    except TransportUnavailable as e:
        reason = str(e)
    else:
        if nixl.unavailable_backends:          # some of several loaded: NixlTransport warned
            nixl.fallback_from = ",".join(nixl.unavailable_backends)
        return nixl
    if requested != ["UCX"]:
        try:
            nixl = nixl_mod.NixlTransport(agent_name, backends=["UCX"],
                                          backend_options=backend_options, ucx_host=ucx_host)
        except TransportUnavailable as e:
            reason += f"; UCX: {e}"
        else:
            logger.warning("KV transfer: NIXL backend %s is not available here (%s); falling back "
                           "to NIXL UCX.", asked, reason)
            nixl.fallback_from = asked
            return nixl
    logger.warning("KV transfer: NIXL backend %s is not available here (%s); falling back to "
                   "kvrelay's TCP transport.", asked, reason)
    tcp = TcpTransport(host=host, port=port, secret=secret, serve=serve,
                       identity=agent_name or "")
    tcp.fallback_from = asked
    return tcp
