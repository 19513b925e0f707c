"""Is a listening port free? Asked before anything slow starts, so a taken port is one
line within a second instead of an error after the model has loaded."""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from kvrelay import envs

if TYPE_CHECKING:
    from kvrelay.config import EngineArgs


def unavailable(host: str, port: int) -> str | None:
    """None when (host, port) can be listened on now, else why not (the OS's words).
    SO_REUSEADDR as uvicorn sets it: a port in TIME_WAIT is free, one with a listener is not."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as e:
            return (e.strerror or str(e)).lower()
    return None


def serve_ports(host: str, port: int, engine: EngineArgs) -> list[tuple[str, str, int]]:
    """(what, host, port) `kvrelay serve` will listen on: HTTP at host:port, and for a KV
    producer (kv_producer / kv_both) the side channel of each local data-parallel replica."""
    claims = [("HTTP", host, port)]
    kv = engine.kv_transfer_config or {}
    if kv and kv.get("kv_role", "kv_both") in ("kv_producer", "kv_both"):
        base = envs.SIDE_CHANNEL_PORT.as_int() or 0
        side = envs.SIDE_CHANNEL_HOST.raw() or "127.0.0.1"
        local = engine.data_parallel_size_local or engine.data_parallel_size
        first = engine.data_parallel_start_rank
        claims += [(f"KV side channel ({envs.SIDE_CHANNEL_PORT.shown})", side, base + first + r)
                   for r in range(local)] if base else []
    return claims


def check_serve_ports(host: str, port: int, engine: EngineArgs) -> None:
    """OSError naming the first port `kvrelay serve` cannot listen on."""
    for what, where, number in serve_ports(host, port, engine):
        reason = unavailable(where, number)
        if reason:
            raise OSError(f"cannot listen on {where}:{number} ({what}): {reason}; stop what "
                          f"uses it or choose another port")
