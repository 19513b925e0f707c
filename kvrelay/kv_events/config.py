"""`--kv-events-config`: vLLM's KVEventsConfig, its fields and meaning, and kvrelay's extensions.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,
     "max_queue_size": 100000, "topic": "",
     "bind": null, "auth": null, "secret_file": null}          (the last three: kvrelay's)

Every key is optional. `publisher` unset means "zmq" when events are enabled, else "null"
(vLLM's rule). An unknown key, a wrong type or a bad value is a ValueError naming the flag
and the key. With data parallelism each replica publishes on its own ports: the endpoint's
TCP port plus the replica's rank (vLLM's `offset_endpoint_port`).

Where kvrelay differs from vLLM, on purpose: the events carry the token ids of every cached
prompt block, so an unset `endpoint` binds loopback (`tcp://127.0.0.1:5557`), not vLLM's
`tcp://*:5557` (every interface). Listening further is written out: a wildcard endpoint, or
`"bind": true` for one interface's address (vLLM's rule would connect to it). `"auth":
"kv_secret"` encrypts and authenticates both sockets with CURVE keys derived from the KV
secret (kv_events/curve.py): only a subscriber holding that secret gets anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvrelay import envs

FLAG = "--kv-events-config"
PUBLISHERS = ("null", "zmq")
AUTH_MODES = ("kv_secret",)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"   # an unset endpoint: bound, loopback only
VLLM_DEFAULT_ENDPOINT = "tcp://*:5557"      # vLLM's: every interface
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None             # "zmq" | "null"; unset: zmq when enabled
    endpoint: str | None = None              # PUB: unset binds DEFAULT_ENDPOINT; a wildcard /
                                             # ipc / inproc binds, any other host connects
    replay_endpoint: str | None = None       # ROUTER for replay requests (always binds)
    buffer_steps: int = 10_000               # batches kept for replay
    hwm: int = 100_000                       # the PUB socket's send high-water mark
    max_queue_size: int = 100_000            # batches waiting for the publisher thread
    topic: str = ""                          # first frame of every message
    # kvrelay's extensions (docs/serving.md, "KV cache events")
    bind: bool | None = None                 # None: vLLM's rule above; True: bind `endpoint`
    auth: str | None = None                  # "kv_secret": CURVE keyed from the KV secret
    secret_file: str | None = None           # the KV secret, when KVRELAY_KV_SECRET is unset

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
        if self.bind is not None and self.endpoint is None:
            raise ValueError(f"{FLAG}: bind needs an endpoint (unset, the endpoint binds "
                             f"{DEFAULT_ENDPOINT})")
        if self.auth is not None and self.auth not in AUTH_MODES:
            raise ValueError(f"{FLAG}: auth {self.auth!r} is not one of "
                             f"{', '.join(AUTH_MODES)} (or null: no authentication)")
        if self.secret_file is not None and self.auth is None:
            raise ValueError(f'{FLAG}: secret_file is read only with "auth": "kv_secret"')
        if self.auth is not None and self.active:
            read_secret(self.secret_file)                    # there, and readable: now

    @property
    def pub_endpoint(self) -> str:
        """The PUB socket's endpoint as given, or the loopback default."""
        return self.endpoint if self.endpoint is not None else DEFAULT_ENDPOINT

    @property
    def pub_binds(self) -> bool:
        """Whether the PUB socket binds: the default does, `bind` decides when set, else
        vLLM's rule (a wildcard host or a local transport binds, any other host connects)."""
        if self.endpoint is None:
            return True
        if self.bind is not None:
            return self.bind
        return vllm_binds(self.endpoint)

    def exposed(self) -> list[str]:
        """The endpoints this config listens on beyond loopback (bound TCP endpoints whose
        host is a wildcard or not a loopback address), or connects to off this host."""
        out = []
        if self.active and is_remote_tcp(self.pub_endpoint):
            out.append(self.pub_endpoint)
        if self.active and self.replay_endpoint and is_remote_tcp(self.replay_endpoint):
            out.append(self.replay_endpoint)
        return out

    @property
    def active(self) -> bool:
        """Events are recorded and published (enabled with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, data_parallel_rank: int) -> KVEventsConfig:
        """This data-parallel replica's endpoints (rank 0 keeps them as given; an unset
        endpoint becomes the default's, still bound)."""
        if data_parallel_rank == 0:
            return self
        return replace(self, endpoint=offset_endpoint(self.pub_endpoint, data_parallel_rank),
                       bind=self.pub_binds,
                       replay_endpoint=offset_endpoint(self.replay_endpoint,
                                                       data_parallel_rank))


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,), "publisher": (str, type(None)),
    "endpoint": (str, type(None)), "replay_endpoint": (str, type(None)), "buffer_steps": (int,),
    "hwm": (int,), "max_queue_size": (int,), "topic": (str,), "bind": (bool, type(None)),
    "auth": (str, type(None)), "secret_file": (str, type(None)),
}


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard host or a local transport, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def tcp_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (brackets stripped), None for any other transport."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")


def is_remote_tcp(endpoint: str) -> bool:
    """A TCP endpoint reachable from (or reaching) other hosts: any host but a loopback
    address or `localhost` (a wildcard `*`, `0.0.0.0`, `::` included)."""
    host = tcp_host(endpoint)
    if host is None:
        return False
    return not (host in ("localhost", "::1") or host.startswith("127."))


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


def read_secret(secret_file: str | None, what: str = FLAG,
                file_option: str = '"secret_file"') -> bytes:
    """The KV secret: KVRELAY_KV_SECRET (as the KV plane reads it), else the file's text; a
    ValueError naming `what` when neither gives one."""
    value = envs.KV_SECRET.raw()
    if value:
        return value.encode()
    if not secret_file:
        raise ValueError(f'{what}: "auth": "kv_secret" needs the KV secret: set '
                         f"{envs.KV_SECRET.name} or give {file_option}")
    try:
        text = Path(os.path.expanduser(secret_file)).read_text().strip()
    except OSError as e:
        raise ValueError(f"{what}: cannot read the secret file {secret_file!r}: "
                         f"{e.strerror or e}") from None
    if not text:
        raise ValueError(f"{what}: the secret file {secret_file!r} is empty")
    return text.encode()
