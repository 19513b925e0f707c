"""What the user asked `kvrelay deploy` for, as frozen dataclasses.

Flags and the YAML file are both turned into one settings mapping (the YAML schema;
flags given on the command line override the file), then into a `Topology`:

    model: openai/gpt-oss-120b          # checkpoint dir or hub id (absent: the embedded model)
    served_model_name: null             # --served-model-name for every server
    preset: tutorial                    # tutorial | none (default: tutorial for the built-in ids)
    connector: nixl                     # nixl | tcp
    kv_backend: LIBFABRIC               # NIXL backend (default: LIBFABRIC with the
                                        #   tutorial preset, else UCX)
    devices: 0-63                       # device ids of each host (default: this
                                        #   machine's CPU cores)
    hosts: {prefill: [A], decode: [B], proxy: A}
    ports: {proxy: 8000, prefill: 8100, decode: 8200,
            prefill_side_channel: 5559, decode_side_channel: 5659}
    prefill: {count: 16, tp: 4, dp: 1, enable_expert_parallel: true, ep_degree: 2,
              max_num_seqs: 1, args: []}
    decode:  {count: 1, tp: 8, dp: 8, enable_expert_parallel: true, max_num_seqs: 4, args: []}
    single:  {tp: 8}                    # instead of prefill/decode: one server, no proxy
    serve_args: []                      # appended to every server's command
    proxy_args: [--routing, cache_aware, --disagg-policy, auto]   # appended to the proxy's
    env: {}                             # set for every server

Layout and port checks live in `plan.py`, where the effective values are known.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvrelay.envs import parse_id_list

ROLES = ("single", "prefill", "decode")
PRESETS = ("tutorial", "none")
CONNECTORS = ("nixl", "tcp")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
TOP_KEYS = {"model", "served_model_name", "preset", "connector", "kv_backend", "devices", "hosts",
            "ports", "serve_args", "proxy_args", "env", *ROLES}
ROLE_KEYS = {"count", "tp", "dp", "enable_expert_parallel", "ep_degree", "max_num_seqs", "args"}


class TopologyError(ValueError):
    """One or more reasons a topology cannot be deployed, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class RoleSpec:
    """One kind of server: `count` identical `kvrelay serve` processes of TP×DP ranks."""

    role: str                               # single | prefill | decode
    count: int = 1
    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False           # --enable-expert-parallel
    ep_degree: int | None = None            # neuron_config.ep_degree: EP inside one replica
    max_num_seqs: int | None = None
    hosts: tuple[str, ...] = ("127.0.0.1",)
    args: tuple[str, ...] = ()

    @property
    def ranks(self) -> int:
        """Devices one server uses: one per rank."""
        return self.tp * self.dp

    @property
    def kv_role(self) -> str | None:
        return {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.role)


@dataclass(frozen=True)
class Ports:
    """First port of each series; server i of a role takes first + i (side channel: one per
    DP rank)."""

    proxy: int = 8000
    prefill: int = 8100
    decode: int = 8200
    prefill_side_channel: int = 5559
    decode_side_channel: int = 5659


@dataclass(frozen=True)
class Topology:
    model: str | None                       # None: kvrelay serve's embedded default model
    roles: tuple[RoleSpec, ...]
    served_model_name: str | None = None
    preset: str = "none"
    connector: str = "nixl"
    kv_backend: str = "UCX"
    devices: tuple[int, ...] = (0,)
    proxy_host: str = "127.0.0.1"
    ports: Ports = field(default_factory=Ports)
    serve_args: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()        # appended to the proxy's command (routing flags)
    env: tuple[tuple[str, str], ...] = ()

    def role(self, name: str) -> RoleSpec | None:
        return next((r for r in self.roles if r.role == name), None)

    @property
    def disaggregated(self) -> bool:
        return self.role("single") is None

    @property
    def local(self) -> bool:
        """Every process on this machine (loopback addresses only)."""
        return all(h in LOOPBACK for r in self.roles
                   for h in r.hosts) and self.proxy_host in LOOPBACK


# ---------------------------------------------------------------------------- settings → Topology

def merge_settings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` wins; nested mappings merge key by key; lists from `over` replace."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = value
    return merged


def topology_from_settings(s: dict[str, Any], default_preset: str,
                           this_machine: tuple[int, ...] | None = None
                           ) -> Topology:
    """Build and sanity-check a Topology from the YAML-shaped settings mapping."""
    problems: list[str] = []
    unknown = sorted(set(s) - TOP_KEYS)
    if unknown:
        raise TopologyError([f"unknown setting {unknown[0]!r} (known: "
                             f"{', '.join(sorted(TOP_KEYS))})"])
    model = s.get("model")
    if model is not None and (not model or not isinstance(model, str)):
        raise TopologyError([("model: expected a checkpoint directory or a hub id such as "
                              f"openai/gpt-oss-120b, got {model!r}")])
    preset = s.get("preset") or default_preset
    connector = s.get("connector") or "nixl"
    if preset not in PRESETS:
        problems.append(f"preset {preset!r}: expected one of {', '.join(PRESETS)}")
    if connector not in CONNECTORS:
        problems.append(f"connector {connector!r}: expected one of {', '.join(CONNECTORS)}")
    default_backend = "TCP" if connector == "tcp" else ("LIBFABRIC" if preset == "tutorial"
                                                        else "UCX")
    hosts = _hosts(s.get("hosts"), problems)
    roles = _roles(s, hosts, problems)
    ports = _ports(s.get("ports") or {}, problems)
    devices = _devices(s.get("devices"), this_machine, problems)
    env = s.get("env") or {}
    if not isinstance(env, dict):
        problems.append("env: expected a mapping of variable names to values")
        env = {}
    if problems:
        raise TopologyError(problems)
    first_prefill = next((r.hosts[0] for r in roles if r.role in ("prefill", "single")),
                         "127.0.0.1")
    return Topology(
        model=model, roles=roles, served_model_name=s.get("served_model_name"), preset=preset,
        connector=connector, kv_backend=str(s.get("kv_backend") or default_backend).upper(),
        devices=devices, proxy_host=str(hosts.get("proxy", [first_prefill])[0]), ports=ports,
        serve_args=_str_tuple(s.get("serve_args"), "serve_args", problems),
        proxy_args=_str_tuple(s.get("proxy_args"), "proxy_args", problems),
        env=tuple((str(k), str(v)) for k, v in env.items()))


def _roles(s: dict[str, Any], hosts: dict[str, list[str]],
           problems: list[str]) -> tuple[RoleSpec, ...]:
    sections = {name: s[name] for name in ROLES if s.get(name) is not None}
    for name, sec in sections.items():
        if not isinstance(sec, dict):
            problems.append(f"{name}: expected a mapping such as {{count: 1, tp: 1}}")
    sections = {n: sec for n, sec in sections.items() if isinstance(sec, dict)
                and sec.get("count", 1) != 0}
    if "single" in sections and len(sections) > 1:
        problems.append("single together with prefill/decode: a topology is either one server or "
                        "prefill + decode")
    elif set(sections) == {"prefill"} or set(sections) == {"decode"}:
        missing = ({"prefill", "decode"} - set(sections)).pop()
        problems.append(f"disaggregated serving needs at least one {missing} server (--{missing} "
                        "N); for a single instance leave out --prefill and --decode")
    if not sections:
        sections = {"single": {}}
    roles = []
    for name in ("single", "prefill", "decode"):
        if name in sections:
            roles.append(_role(name, sections[name],
                               hosts.get(name) or hosts.get("all") or ["127.0.0.1"], problems))
    return tuple(roles)


def _role(name: str, sec: dict[str, Any], hosts: list[str], problems: list[str]) -> RoleSpec:
    unknown = sorted(set(sec) - ROLE_KEYS)
    if unknown:
        problems.append(f"{name}: unknown setting {unknown[0]!r} (known: "
                        f"{', '.join(sorted(ROLE_KEYS))})")
    values: dict[str, Any] = {}
    for key in ("count", "tp", "dp", "ep_degree", "max_num_seqs"):
        value = sec.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name}.{key}: expected a positive integer, got {value!r}")
            continue
        values[key] = value
    if name == "single" and values.get("count", 1) != 1:
        problems.append(f"single.count: a single instance is one server, got {values['count']}")
    return RoleSpec(role=name, expert_parallel=bool(sec.get("enable_expert_parallel", False)),
                    hosts=tuple(hosts), args=_str_tuple(sec.get("args"), f"{name}.args", problems),
                    **values)


def _hosts(raw: Any, problems: list[str]) -> dict[str, list[str]]:
    """`{prefill: [A, B], decode: B, proxy: A}`; the flag form `ROLE=H[,H]` or a bare `H`
    (every role)."""
    if raw is None:
        return {}
    if isinstance(raw, (list, tuple)):
        parsed: dict[str, list[str]] = {}
        for item in raw:
            text = str(item)
            role, _sep, listed = text.rpartition("=") if "=" in text else ("all", "", text)
            parsed.setdefault(role or "all", []).extend(h for h in listed.split(",") if h)
        raw = parsed
    if not isinstance(raw, dict):
        problems.append("hosts: expected a mapping such as {prefill: [PREFILL_HOST], decode: "
                        "[DECODE_HOST]}")
        return {}
    out: dict[str, list[str]] = {}
    for role, names in raw.items():
        if role not in (*ROLES, "proxy", "all"):
            problems.append(f"hosts: unknown role {role!r} (prefill, decode, single, proxy)")
            continue
        hosts = [names] if isinstance(names, str) else list(names or [])
        if not hosts or not all(isinstance(h, str) and h for h in hosts):
            problems.append(f"hosts.{role}: expected host names")
            continue
        out[role] = hosts
    return out


def _ports(raw: Any, problems: list[str]) -> Ports:
    if not isinstance(raw, dict):
        problems.append("ports: expected a mapping such as {proxy: 8000, prefill: 8100}")
        return Ports()
    known = {f.name for f in fields(Ports)}
    unknown = sorted(set(raw) - known)
    if unknown:
        problems.append(f"ports: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    values = {}
    for key in known & set(raw):
        value = raw[key]
        if not isinstance(value, int) or not 1 <= value <= 65535:
            problems.append(f"ports.{key}: {value!r} is not a TCP port")
        else:
            values[key] = value
    return Ports(**values)


def ports_from_flags(port: int | None, base: int | None,
                     side_channel: int | None) -> dict[str, int]:
    """--port P: the proxy (or the single instance) on P; --base-port B: prefill B+100…,
    decode B+200… (the tutorial's 8100/8200 from 8000), the proxy staying on --port;
    --side-channel-port S: prefill S…, decode S+100… (the tutorial's 5559/5659)."""
    out: dict[str, int] = {}
    if port is not None:
        out["proxy"] = port
    if base is not None:
        out |= {"prefill": base + 100, "decode": base + 200}
    if side_channel is not None:
        out |= {"prefill_side_channel": side_channel, "decode_side_channel": side_channel + 100}
    return out


def _devices(raw: Any, this_machine: tuple[int, ...] | None,
             problems: list[str]) -> tuple[int, ...]:
    if raw is None:
        return this_machine or tuple(sorted(os.sched_getaffinity(0)))
    try:
        ids = parse_id_list(str(raw)) if not isinstance(raw, list) else [int(i) for i in raw]
    except ValueError as e:
        problems.append(f"devices: {e}")
        return (0,)
    if not ids or len(set(ids)) != len(ids):
        problems.append(f"devices: {raw!r} must name distinct device ids")
        return (0,)
    return tuple(ids)


def _str_tuple(raw: Any, what: str, problems: list[str]) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        import shlex
        return tuple(shlex.split(raw))
    if not isinstance(raw, (list, tuple)):
        problems.append(f"{what}: expected a list of command-line words")
        return ()
    return tuple(str(a) for a in raw)


def load_yaml(path: Path) -> dict[str, Any]:
    import yaml
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise TopologyError([f"{path}: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise TopologyError([f"{path}: not valid YAML ({e})"]) from None
    if not isinstance(data, dict):
        raise TopologyError([f"{path}: expected a mapping at the top "
                             "(model:, prefill:, decode: …)"])
    return data
