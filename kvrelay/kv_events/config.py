"""`--kv-events-config`: vLLM's KVEventsConfig, its fields, defaults and meaning.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,
     "max_queue_size": 100000, "topic": ""}

Every key is optional. `publisher` unset means "zmq" when events are enabled, else "null"
(vLLM's rule). An unknown key, a wrong type or a bad value is a ValueError naming the flag
and the key. With data parallelism each replica publishes on its own ports: the endpoint's
TCP port plus the replica's rank (vLLM's `offset_endpoint_port`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

FLAG = "--kv-events-config"
PUBLISHERS = ("null", "zmq")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None             # "zmq" | "null"; unset: zmq when enabled
    endpoint: str = "tcp://*:5557"           # PUB: a wildcard / ipc / inproc binds, else connects
    replay_endpoint: str | None = None       # ROUTER for replay requests (always binds)
    buffer_steps: int = 10_000               # batches kept for replay
    hwm: int = 100_000                       # the PUB socket's send high-water mark
    max_queue_size: int = 100_000            # batches waiting for the publisher thread
    topic: str = ""                          # first frame of every message

    def __post_init__(self) -> None:
        if self.publisher is None:                               # vLLM's rule
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @classmethod
    def from_json(cls, raw: dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        """The flag's object checked and resolved; None when the flag is unset. (`LLM(...,
        kv_events_config=KVEventsConfig(...))` passes the dataclass itself.)"""
        if raw is None:
            return None
        if isinstance(raw, KVEventsConfig):
            raw.check()
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"{FLAG} must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{FLAG}: unknown key {unknown[0]!r} (expected one of "
                             f"{', '.join(known)})")
        for name, value in raw.items():
            _check_type(name, value)
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"{FLAG}: publisher {self.publisher!r} is not one of "
                             f"{', '.join(PUBLISHERS)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_SCHEMES):
                raise ValueError(f"{FLAG}: {name} {value!r} must start with tcp://, ipc:// or "
                                 "inproc://")
            if value is not None and value.startswith("tcp://"):
                _tcp_port(name, value)
        if self.buffer_steps < 0 or self.hwm < 0:
            raise ValueError(f"{FLAG}: buffer_steps and hwm must be ≥ 0 (0: no replay buffer / "
                             "no high-water mark)")
        if self.max_queue_size < 1:
            raise ValueError(f"{FLAG}: max_queue_size must be ≥ 1 (the queue is bounded: a "
                             "full queue drops batches, it never blocks a step)")

    @property
    def active(self) -> bool:
        """Events are recorded and published (enabled with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, data_parallel_rank: int) -> KVEventsConfig:
        """This data-parallel replica's endpoints (rank 0 keeps them as given)."""
        return replace(self, endpoint=offset_endpoint(self.endpoint, data_parallel_rank) or "",
                       replay_endpoint=offset_endpoint(self.replay_endpoint,
                                                       data_parallel_rank))


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,), "publisher": (str, type(None)), "endpoint": (str,),
    "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
    "max_queue_size": (int,), "topic": (str,),
}


def _check_type(name: str, value: Any) -> None:
    types = _TYPES[name]
    wrong_bool = isinstance(value, bool) and bool not in types      # bool is an int
    if wrong_bool or not isinstance(value, types):
        want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{FLAG}: {name} must be {want}, got {value!r}")


def _tcp_port(name: str, endpoint: str) -> int:
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{FLAG}: {name} {endpoint!r} is not tcp://HOST:PORT")
    return int(port)


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-replica endpoint: TCP port + rank (a port of 0 stays 0: the OS picks);
    ipc:// and inproc:// get a `_dp<rank>` suffix (vLLM does so for inproc only)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"
