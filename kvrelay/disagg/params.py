"""`kv_transfer_params` (vLLM's wire format) and `--kv-transfer-config`, as dataclasses.

    proxy → prefill:  {"do_remote_decode": true, "do_remote_prefill": false, remote_*: null}
    prefill → proxy:  {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id",
                       "remote_block_ids": [[...full group...], [...sliding group...]],
                       "remote_host", "remote_port", "remote_request_id", "tp_size",
                       "remote_capability",   (kvrelay's extra key: see docs/security.md)
                       "remote_mac"}          (with a KV secret only: the prefill's MAC over
                                               the params and the prompt, auth.params_mac)
    proxy → decode:   the prefill's params, unchanged

A decode with a KV secret verifies `remote_mac` before it dials anything
(`KVConnector.verify_params`), and with `kv_connector_extra_config.allowed_prefills`
dials only the listed side channels; a refusal is a `KVParamsError` (HTTP 400 naming
`kv_transfer_params`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvrelay import envs

ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("fail", "recompute")
PARAM = "kv_transfer_params"


class KVParamsError(ValueError):
    """A request's kv_transfer_params are malformed, forged or not this decode's to use:
    the client's mistake (HTTP 400 with `param` "kv_transfer_params")."""

    param = PARAM


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[list[int]] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int | None = None
    # kvrelay's extra key: the prefill's unguessable per-request capability. Decode must
    # present it to read or release the request's blocks (vLLM's proxy passes it through).
    remote_capability: str | None = None
    # kvrelay's extra key, with a KV secret: the prefill's MAC over the fields above and
    # the prompt (auth.params_mac). A decode with the secret loads nothing without it.
    remote_mac: str | None = None

    @classmethod
    def from_dict(cls, raw: Any) -> KVTransferParams | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise KVParamsError("kv_transfer_params must be an object")
        given: dict[str, Any] = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        for flag in ("do_remote_decode", "do_remote_prefill"):    # a truthy 1 once held
            if not isinstance(given.get(flag, False), bool):
                raise KVParamsError(f"kv_transfer_params.{flag} must be a JSON boolean")
        p = cls(**given)
        if p.do_remote_prefill:
            required = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
                        "remote_request_id", "remote_capability")
            missing = [k for k in required if getattr(p, k) in (None, "")]
            if missing:
                raise KVParamsError(f"kv_transfer_params.do_remote_prefill needs "
                                    f"{', '.join(missing)}")
            ids = p.remote_block_ids
            if not isinstance(ids, list) or not all(
                    isinstance(g, list) and all(isinstance(b, int) and b >= 0 for b in g)
                    for g in ids):
                raise KVParamsError("kv_transfer_params.remote_block_ids must be a list of "
                                    "block-id lists (one per KV-cache group)")
            if not isinstance(p.remote_port, int) or not 0 < p.remote_port < 65536:
                raise KVParamsError("kv_transfer_params.remote_port must be a TCP port")
            if not isinstance(p.remote_host, str) or len(p.remote_host) > 255:
                raise KVParamsError("kv_transfer_params.remote_host must be a host name or "
                                    "address")
            if not isinstance(p.remote_capability, str) or len(p.remote_capability) > 256:
                raise KVParamsError("kv_transfer_params.remote_capability must be the string "
                                    "the prefill issued")
            if p.remote_mac is not None and (not isinstance(p.remote_mac, str)
                                             or len(p.remote_mac) > 128):
                raise KVParamsError("kv_transfer_params.remote_mac must be the string the "
                                    "prefill issued")
        return p

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["remote_mac"] is None:          # without a secret: vLLM's keys as before
            del out["remote_mac"]
        return out


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    kv_buffer_device: str = "cuda"
    backends: tuple[str, ...] = ("UCX",)
    kv_load_failure_policy: str = "fail"
    lease_s: float = 120.0                 # prefill frees held blocks at the latest after this
    load_timeout_s: float = 60.0           # decode gives up waiting for a transfer after this
    # prefill: blocks held for decode servers may fill at most this share of the KV pool;
    # a finished do_remote_decode request over it gets its blocks freed and an error
    hold_share: float = 0.5
    # prefill, HTTP layer: per client, at most hold_rate do_remote_decode holds per second
    # (0: no bound), hold_burst at once (kvrelay/server/hold_limit.py)
    hold_rate: float = 100.0
    hold_burst: float = 200.0
    max_connections: int = 256             # per KV listener (side channel); TCP transport: 64
    # decode: the only prefill side channels (host, port) it may dial; None: any (with a KV
    # secret still only those a prefill signed)
    allowed_prefills: frozenset[tuple[str, int]] | None = None
    engine_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> KVTransferConfig | None:
        if raw is None:
            return None
        known = {"kv_connector", "kv_role", "kv_buffer_device", "kv_connector_extra_config",
                 "kv_load_failure_policy", "engine_id",
                 "kv_rank", "kv_parallel_size", "kv_ip", "kv_port"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown key {unknown[0]!r}")
        if raw.get("kv_connector", "NixlConnector") not in ("NixlConnector", "TcpConnector"):
            raise ValueError(f"--kv-transfer-config: kv_connector {raw['kv_connector']!r} is not "
                             "supported (NixlConnector or TcpConnector)")
        role = raw.get("kv_role", "kv_both")
        if role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}, "
                             f"got {role!r}")
        device = raw.get("kv_buffer_device", "cuda")
        if device not in ("cuda", "cpu"):
            raise ValueError("--kv-transfer-config: kv_buffer_device must be cuda or cpu, got "
                             f"{device!r}")
        extra = dict(raw.get("kv_connector_extra_config") or {})
        policy = raw.get("kv_load_failure_policy", extra.pop("kv_load_failure_policy", "fail"))
        if policy not in FAILURE_POLICIES:
            raise ValueError("--kv-transfer-config: kv_load_failure_policy must be fail or "
                             f"recompute, got {policy!r}")
        backends = extra.pop("backends",
                             ["UCX"] if raw.get("kv_connector") != "TcpConnector" else ["TCP"])
        if not isinstance(backends, list) or not backends:
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.backends must be a "
                             "non-empty list")
        hold_share = _number(extra.pop("hold_share", 0.5), "hold_share")
        if not 0 < hold_share <= 1:
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.hold_share must "
                             f"be in (0, 1], got {hold_share}")
        hold_rate = _number(extra.pop("hold_rate", 100.0), "hold_rate")
        hold_burst = _number(extra.pop("hold_burst", 200.0), "hold_burst")
        if hold_rate < 0 or not hold_rate < float("inf"):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.hold_rate must "
                             f"be a finite number >= 0 (0: no bound), got {hold_rate}")
        if hold_burst < 1 or not hold_burst < float("inf"):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.hold_burst must "
                             f"be a finite number >= 1, got {hold_burst}")
        max_connections = _number(extra.pop("max_connections", 256), "max_connections")
        if max_connections < 1 or max_connections != int(max_connections):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.max_connections "
                             f"must be a positive integer, got {max_connections}")
        allowed = _allowed_prefills(extra.pop("allowed_prefills", None))
        secret_file = extra.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.secret_file must be "
                             "a path")
        return cls(kv_connector=raw.get("kv_connector", "NixlConnector"), kv_role=role,
                   kv_buffer_device=device, backends=tuple(str(b).upper() for b in backends),
                   kv_load_failure_policy=policy,
                   lease_s=float(extra.pop("lease_s", None) or envs.KV_LEASE_S.as_float() or 120.0),
                   load_timeout_s=float(extra.pop("load_timeout_s", 60.0)),
                   hold_share=hold_share, hold_rate=hold_rate, hold_burst=hold_burst,
                   max_connections=int(max_connections), allowed_prefills=allowed,
                   engine_id=raw.get("engine_id"), extra=extra)


def parse_endpoint(text: str) -> tuple[str, int]:
    """"host:port" or "[v6 address]:port" → (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


def _allowed_prefills(value: Any) -> frozenset[tuple[str, int]] | None:
    """kv_connector_extra_config.allowed_prefills: a list of "host:port" (each a prefill's
    advertised side channel, exactly as it appears in its kv_transfer_params)."""
    if value is None:
        return None
    key = "--kv-transfer-config: kv_connector_extra_config.allowed_prefills"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of \"host:port\" strings")
    try:
        return frozenset(parse_endpoint(v.strip()) for v in value)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be a number, "
                         f"got {value!r}")
    return float(value)
