"""Turn a `Topology` into every process's host, ports, device slice, environment and command.

Assignment, for the tutorial's 16 × TP4 prefill + TP8 DP8 EP64 decode on two hosts
(`--hosts prefill=PREFILL_HOST decode=DECODE_HOST --devices 0-63`):

    server      host           HTTP   side channel   devices (NEURON_VISIBLE_DEVICES)
    prefill-0   PREFILL_HOST   8100   5559           0-3
    prefill-1   PREFILL_HOST   8101   5560           4-7
    …
    prefill-15  PREFILL_HOST   8115   5574           60-63
    decode-0    DECODE_HOST    8200   5659-5666      0-63     (one side-channel port per DP rank)
    proxy       PREFILL_HOST   8000

- Servers of a role are spread over that role's hosts in contiguous runs (16 over two
  hosts: 0-7 on the first, 8-15 on the second).
- Each host hands out its device list in order, `tp × dp` devices per server; when a
  host's servers need more than it has, the list wraps around and slices overlap
  (CPU cores are then shared — said in a warning; on Neuron/GPU it needs more devices).
- Server i of a role listens on `ports.<role> + i`; its side channel on `ports.<role>_side_channel`
  plus the DP ranks of the servers before it. Every (host, port) must be unique.
"""
from __future__ import annotations

import importlib.util
import json
import shlex
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.deploy.shapes import served_name_of, tutorial_defaults
from kvrelay.deploy.topology import LOOPBACK, RoleSpec, Topology, TopologyError
from kvrelay.model.config import GptOssConfig

# flags deploy sets itself; passing them through would contradict the plan
RESERVED_FLAGS = {"--host", "--port", "--tensor-parallel-size", "-tp", "--data-parallel-size",
                  "-dp", "--enable-expert-parallel", "--kv-transfer-config", "--served-model-name"}
TUTORIAL_MAX_NUM_SEQS = {"single": 4, "prefill": 1, "decode": 4}
TUTORIAL_MAX_MODEL_LEN = 16384
TUTORIAL_BATCHED_TOKENS = 8192
KV_SECRET_ENV = "KVRELAY_KV_SECRET"
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")     # one entry per GPU the driver sees
# --dry-run prints no secret: how to make one, and a line that refuses to go on without it
KV_SECRET_NOTE = [
    "",
    (f"# KV plane secret ({KV_SECRET_ENV}): `kvrelay deploy` generates one per topology "
     "(secrets.token_hex)"),
    "# and passes it to every server it starts. For these commands, make one value, e.g.",
    "#   python3 -c 'import secrets; print(secrets.token_hex(32))'",
    (f"# and set the same {KV_SECRET_ENV} on every host (not on the command line of a shared "
     "machine)."),
]
KV_SECRET_EXPORT = (f'export {KV_SECRET_ENV}="${{{KV_SECRET_ENV}:?set it to the KV secret '
                    'of this topology, the same on every host}"')


@dataclass(frozen=True)
class ServerPlan:
    name: str                               # prefill-0, decode-0, serve
    role: str
    host: str
    port: int
    side_channel_ports: tuple[int, ...]     # one per DP rank (DI only)
    devices: tuple[int, ...]
    env: tuple[tuple[str, str], ...]        # this server's own variables
    args: tuple[str, ...]                   # after `kvrelay`
    layout: str                             # "TP4 EP2"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class ProxyPlan:
    host: str
    port: int
    args: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Plan:
    topology: Topology
    config: GptOssConfig
    servers: tuple[ServerPlan, ...]
    proxy: ProxyPlan | None
    exports: tuple[tuple[str, str], ...]    # set for every server (the tutorial's `export` lines)
    warnings: tuple[str, ...]

    @property
    def entry(self) -> ServerPlan | ProxyPlan:
        """Where clients (and validate) go: the proxy, or the single server."""
        return self.proxy or self.servers[0]

    def role_servers(self, role: str) -> list[ServerPlan]:
        return [s for s in self.servers if s.role == role]

    @property
    def served_name(self) -> str:
        return served_name_of(self.topology.model, self.topology.served_model_name)


# ---------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class RoleLayout:
    """The effective parallel layout of one role's servers."""

    spec: RoleSpec
    neuron: dict[str, Any]                  # the neuron_config it will be started with
    ep_inner: int                           # EP width inside one replica (ep_degree, or TP with EP)
    ep_width: int                           # experts are split this many ways in all

    @property
    def label(self) -> str:
        s = self.spec
        parts = [f"TP{s.tp}"] + ([f"DP{s.dp}"] if s.dp > 1 else []) + ([f"EP{self.ep_width}"]
                                                                       if self.ep_width > 1 else [])
        return " ".join(parts)


def role_layout(topo: Topology, spec: RoleSpec) -> RoleLayout:
    """EP as `kvrelay serve` derives it: TP × DP with --enable-expert-parallel and DP > 1
    (experts across replicas), else neuron_config.ep_degree, else TP with EP, else 1."""
    from kvrelay.config import ExpertLayout
    neuron = _neuron_config(topo, spec)
    experts = ExpertLayout.of(spec.tp, spec.dp, spec.expert_parallel, neuron.get("ep_degree"))
    return RoleLayout(spec, neuron, experts.inner, experts.width)


def check_layout(layout: RoleLayout, cfg: GptOssConfig) -> list[str]:
    """Problems of one role's layout against the model, each naming the numbers: the
    checks `kvrelay serve` runs at startup (NeuronConfig's keys, validate_layout)."""
    from kvrelay.config import ExpertLayout, NeuronConfig
    s, name = layout.spec, layout.spec.role
    problems = []
    try:
        neuron = NeuronConfig.from_additional_config({"neuron_config": layout.neuron})
        neuron.check_layout(s.tp, s.dp, s.expert_parallel)
    except ValueError as e:
        problems.append(f"{name}: {e}")
    try:
        ExpertLayout.of(s.tp, s.dp, s.expert_parallel, layout.neuron.get("ep_degree")).validate(cfg)
    except ValueError as e:
        problems.append(f"{name}: {e}")
    return problems


def describe_layout(layout: RoleLayout, cfg: GptOssConfig) -> str:
    """'TP4 EP2: 16 heads, 2 KV heads, 64 experts per rank' style summary."""
    s = layout.spec
    kv = cfg.num_key_value_heads / s.tp if s.tp <= cfg.num_key_value_heads else 1
    experts = cfg.num_local_experts // layout.ep_width if layout.ep_width else cfg.num_local_experts
    split = s.tp // layout.ep_inner if s.dp == 1 or not s.expert_parallel else 1
    moe = f"{_count(experts, 'expert')} per rank" + (f" (each split over {split} ranks)"
                                                     if split > 1 else "")
    return (f"{layout.label}: {_count(s.ranks, 'device')} per server; per rank "
            f"{_count(cfg.num_attention_heads // s.tp, 'head')}, {_count(kv, 'KV head')}, {moe}")


def _count(n: float, what: str) -> str:
    return f"{n:g} {what}{'' if n == 1 else 's'}"


# ---------------------------------------------------------------------------- the plan

def make_plan(topo: Topology, cfg: GptOssConfig) -> Plan:
    """Every process of `topo`; raises TopologyError listing every problem found."""
    layouts = {spec.role: role_layout(topo, spec) for spec in topo.roles}
    problems = [p for lay in layouts.values() for p in check_layout(lay, cfg)]
    problems += _reserved_flag_problems(topo)
    problems += _proxy_arg_problems(topo)
    if "prefill" in layouts and "decode" in layouts:       # the KV handshake's own rule
        from kvrelay.disagg.layout import tp_mismatch
        mismatch = tp_mismatch(layouts["prefill"].spec.tp, layouts["decode"].spec.tp)
        if mismatch:
            problems.append(mismatch)
    warnings = _tested_layout_warnings(topo, layouts)
    servers = _servers(topo, layouts, warnings)
    proxy = _proxy(topo, servers) if topo.disaggregated else None
    problems += _port_problems(servers, proxy)
    if problems:
        raise TopologyError(problems)
    return Plan(topo, cfg, tuple(servers), proxy, _exports(topo), tuple(warnings))


def _servers(topo: Topology, layouts: dict[str, RoleLayout],
             warnings: list[str]) -> list[ServerPlan]:
    cursor: dict[str, int] = defaultdict(int)           # next device index, per host
    used: dict[str, int] = defaultdict(int)             # devices asked for, per host
    out = []
    for spec in topo.roles:
        layout = layouts[spec.role]
        first_port = topo.ports.proxy if spec.role == "single" else getattr(topo.ports, spec.role)
        side = getattr(topo.ports, f"{spec.role}_side_channel", 0)
        for i in range(spec.count):
            host = spec.hosts[i * len(spec.hosts) // spec.count]
            start = cursor[host]
            devices = tuple(topo.devices[(start + k) % len(topo.devices)]
                            for k in range(spec.ranks))
            cursor[host], used[host] = start + spec.ranks, used[host] + spec.ranks
            name = "serve" if spec.role == "single" else f"{spec.role}-{i}"
            port = first_port + i
            sides = tuple(range(side + i * spec.dp,
                                side + (i + 1) * spec.dp)) if topo.disaggregated else ()
            env = [("NEURON_VISIBLE_DEVICES", format_ids(devices))]
            if sides:
                env.append(("VLLM_NIXL_SIDE_CHANNEL_PORT", str(sides[0])))
            out.append(ServerPlan(name, spec.role, host, port, sides, devices, tuple(env),
                                  _serve_args(topo, layout, port), layout.label))
    for host, n in used.items():
        if n > len(topo.devices):
            warnings.append(f"host {host}: {n} ranks on {len(topo.devices)} devices "
                            f"({format_ids(topo.devices)}): device slices overlap, so CPU cores "
                            "are shared (one thread per rank); on Neuron or GPUs this layout needs "
                            f"{n} devices per host")
    return out


def _serve_args(topo: Topology, layout: RoleLayout, port: int) -> tuple[str, ...]:
    spec = layout.spec
    args = ["serve", *([topo.model] if topo.model else []), "--host", listen_host(topo), "--port",
            str(port)]
    if topo.served_model_name:
        args += ["--served-model-name", topo.served_model_name]
    args += ["--tensor-parallel-size", str(spec.tp), "--data-parallel-size", str(spec.dp)]
    if spec.expert_parallel:
        args.append("--enable-expert-parallel")
    args += _preset_args(topo, spec)
    if spec.kv_role:
        args += ["--kv-transfer-config",
                 json.dumps(kv_transfer_config(topo, spec.kv_role, kv_buffer_device(topo, spec)))]
    if layout.neuron:
        args += ["--additional-config", json.dumps({"neuron_config": layout.neuron})]
    args += _without_additional_config(topo.serve_args + spec.args)
    return tuple(args)


def kv_transfer_config(topo: Topology, kv_role: str, device: str = "cuda") -> dict[str, Any]:
    """The tutorial's --kv-transfer-config (TcpConnector for `--connector tcp`), with the
    servers' device as kv_buffer_device."""
    if topo.connector == "tcp":
        return {"kv_connector": "TcpConnector", "kv_role": kv_role,
                "kv_connector_extra_config": {"backends": ["TCP"]}}
    return {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": device,
            "kv_connector_extra_config": {"backends": [topo.kv_backend]}}


def kv_buffer_device(topo: Topology, spec: RoleSpec) -> str:
    """Where the role's servers keep their KV blocks: their `--device cpu|cuda` when the
    passthrough flags give one; else, everything on this machine, this machine's device
    (what `--device auto` picks); else (other hosts, unknown from here) the tutorial's cuda."""
    device = _last_flag_value(topo.serve_args + spec.args, "--device")
    if device in ("cpu", "cuda"):
        return device
    return local_device() if topo.local else "cuda"


def local_device(gpus: Path = NVIDIA_GPUS, torch_dirs: list[Path] | None = None) -> str:
    """cuda when `kvrelay serve --device auto` would find CUDA here — an NVIDIA GPU (a
    `gpus` entry) and a torch built with CUDA (libtorch_cuda in `torch_dirs`, default:
    the installed torch's) — else cpu. Looked up without importing torch."""
    if not gpus.is_dir() or not any(gpus.iterdir()):
        return "cpu"
    if torch_dirs is None:
        spec = importlib.util.find_spec("torch")
        torch_dirs = [Path(d) for d in (spec.submodule_search_locations or [])] if spec else []
    found = any(next((d / "lib").glob("libtorch_cuda*"), None) for d in torch_dirs)
    return "cuda" if found else "cpu"


def _last_flag_value(args: tuple[str, ...], name: str) -> str | None:
    """The value of the last `name V` / `name=V` in args (argparse's rule: the last wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.partition("=")[2]
    return value


def _preset_args(topo: Topology, spec: RoleSpec) -> list[str]:
    """The tutorial's serve flags for this role (nothing with preset `none`, but --max-num-seqs)."""
    seqs = max_num_seqs(topo, spec)
    args = ["--max-num-seqs", str(seqs)] if seqs is not None else []
    if topo.preset != "tutorial":
        return args
    tutorial = tutorial_defaults(topo.model, topo.served_model_name)
    head: list[str] = []
    if spec.role == "decode" and tutorial and tutorial.decode_optimization_level is not None:
        head += ["--optimization-level", str(tutorial.decode_optimization_level)]
    if spec.role == "single":
        head.append("--enable-prefix-caching")
    else:
        head += ["--dtype", "bfloat16"]
    head += ["--max-model-len", str(TUTORIAL_MAX_MODEL_LEN), "--max-num-batched-tokens",
             str(TUTORIAL_BATCHED_TOKENS)]
    tail = ["--max-logprobs", "0"] if spec.role == "decode" else []
    tail += ["--no-disable-hybrid-kv-cache-manager", "--hf-overrides",
             json.dumps({"quantization_config": {}})]
    return head + args + tail


def max_num_seqs(topo: Topology, spec: RoleSpec) -> int | None:
    if spec.max_num_seqs is not None:
        return spec.max_num_seqs
    return TUTORIAL_MAX_NUM_SEQS[spec.role] if topo.preset == "tutorial" else None


def _neuron_config(topo: Topology, spec: RoleSpec) -> dict[str, Any]:
    """The role's neuron_config: the tutorial's (preset), ep_degree, then the user's own keys."""
    nc: dict[str, Any] = {}
    if topo.preset == "tutorial":
        seqs = max_num_seqs(topo, spec)
        if spec.role == "single":
            nc = {"num_batched_tokens_buckets": [TUTORIAL_BATCHED_TOKENS],
                  "num_seqs_buckets": [seqs]}
        else:
            nc = {"quantization": "mxfp4"}
            if (spec.role == "prefill" and spec.expert_parallel and spec.tp % 2 == 0
                    and spec.dp == 1):
                nc["ep_degree"] = 2
            if spec.role == "decode" and spec.dp > 1:
                nc |= {"embedding_dp_size": spec.dp, "lm_head_dp_size": spec.dp}
            nc |= {"kv_segment_size_buckets": [TUTORIAL_BATCHED_TOKENS],
                   "num_batched_tokens_buckets": [TUTORIAL_BATCHED_TOKENS],
                   "num_seqs_buckets": [seqs]}
    if spec.ep_degree is not None:
        nc["ep_degree"] = spec.ep_degree
    for raw in _additional_configs(topo.serve_args + spec.args):
        nc |= raw.get("neuron_config") or {}
    return nc


def _additional_configs(args: tuple[str, ...]) -> list[dict[str, Any]]:
    out = []
    for i, a in enumerate(args):
        text = args[i + 1] if a == "--additional-config" and i + 1 < len(args) else \
            a.partition("=")[2] if a.startswith("--additional-config=") else None
        if text is None:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise TopologyError(
                [f"--additional-config {text!r}: malformed JSON ({e.msg})"]) from None
        if not isinstance(value, dict):
            raise TopologyError([f"--additional-config {text!r}: expected a JSON object"])
        out.append(value)
    return out


def _without_additional_config(args: tuple[str, ...]) -> list[str]:
    """The passthrough args less --additional-config (merged into the role's neuron_config)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--additional-config":
            skip = True
        elif not a.startswith("--additional-config="):
            out.append(a)
    return out


def _reserved_flag_problems(topo: Topology) -> list[str]:
    problems = []
    for where, args in [("serve args", topo.serve_args)] + [(f"{r.role} args", r.args)
                                                            for r in topo.roles]:
        for a in args:
            flag = a.split("=", 1)[0]
            if flag in RESERVED_FLAGS:
                problems.append(f"{where}: {flag} is set by deploy from the topology (use deploy's "
                                "own flags: --base-port, --prefill-tp, --decode-dp, "
                                "--enable-expert-parallel, --connector, --served-model-name …)")
    return problems


def _tested_layout_warnings(topo: Topology, layouts: dict[str, RoleLayout]) -> list[str]:
    tutorial = tutorial_defaults(topo.model, topo.served_model_name)
    decode = layouts.get("decode")
    if tutorial is None or decode is None or decode.ep_width in (1, tutorial.decode_ep):
        return []
    return [(f"decode EP{decode.ep_width}: the tutorial tested EP{tutorial.decode_ep} for this "
             f"model (TP{tutorial.decode_tp} DP{tutorial.decode_dp}); other EP degrees have "
             "produced degenerate output")]


def _proxy(topo: Topology, servers: list[ServerPlan]) -> ProxyPlan:
    args = ["proxy", "--port", str(topo.ports.proxy), "--host", listen_host(topo)]
    for role, flag in (("prefill", "prefiller"), ("decode", "decoder")):
        mine = [s for s in servers if s.role == role]
        hosts = [s.host for s in mine]
        args += [f"--{flag}-host", *(hosts[:1] if len(set(hosts)) == 1 else hosts)]
        args += [f"--{flag}-port", *(str(s.port) for s in mine)]
    return ProxyPlan(topo.proxy_host, topo.ports.proxy, tuple(args) + topo.proxy_args)


PROXY_RESERVED = ("--host", "--port", "--prefiller-host", "--prefiller-hosts", "--prefiller-port",
                  "--prefiller-ports", "--decoder-host", "--decoder-hosts", "--decoder-port",
                  "--decoder-ports", "--backends-file")


def _proxy_arg_problems(topo: Topology) -> list[str]:
    """proxy_args checked by the proxy's own parser before anything starts; the flags that
    deploy sets from the topology are refused."""
    if not topo.proxy_args:
        return []
    if not topo.disaggregated:
        return ["proxy_args: a single instance has no proxy"]
    import argparse

    from kvrelay.proxy.main import add_proxy_flags
    reserved = [a for a in topo.proxy_args if a.split("=", 1)[0] in PROXY_RESERVED]
    if reserved:
        return [f"proxy_args: {reserved[0].split('=', 1)[0]} is set by deploy from the topology"]
    parser = argparse.ArgumentParser(prog="kvrelay proxy", exit_on_error=False, add_help=False)
    add_proxy_flags(parser)
    try:
        _, unknown = parser.parse_known_args(list(topo.proxy_args))
    except argparse.ArgumentError as e:
        return [f"proxy_args: {e}"]
    return [f"proxy_args: unknown flag {unknown[0]}"] if unknown else []


def _port_problems(servers: list[ServerPlan], proxy: ProxyPlan | None) -> list[str]:
    taken: dict[tuple[str, int], str] = {}
    problems = []
    claims = [(proxy.host, proxy.port, "proxy HTTP")] if proxy else []
    for s in servers:
        claims.append((s.host, s.port, f"{s.name} HTTP"))
        claims += [(s.host, p, f"{s.name} side channel") for p in s.side_channel_ports]
    for host, port, what in claims:
        key = ("127.0.0.1" if host in LOOPBACK else host, port)
        if not 1 <= port <= 65535:
            problems.append(f"{what} port {port} is not a TCP port (1-65535)")
        elif key in taken:
            problems.append(f"port collision on {host}: {what} and {taken[key]} both use {port}")
        else:
            taken[key] = what
    return problems


def _exports(topo: Topology) -> tuple[tuple[str, str], ...]:
    env: list[tuple[str, str]] = []
    if topo.preset == "tutorial":
        env += [("VLLM_NEURON_COMPILATION_TIMEOUT", "2400" if topo.disaggregated else "1200"),
                ("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1200")]
        if topo.disaggregated:
            env.append(("VLLM_ENGINE_READY_TIMEOUT_S", "5400"))
    if topo.disaggregated:
        env.append(("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1" if topo.local else "0.0.0.0"))
    names = {k for k, _ in topo.env}
    return tuple(kv for kv in env if kv[0] not in names) + topo.env


def listen_host(topo: Topology) -> str:
    """127.0.0.1 when everything runs on this machine, else all interfaces (as the tutorial
    runs)."""
    return "127.0.0.1" if topo.local else "0.0.0.0"


def format_ids(ids: tuple[int, ...] | list[int]) -> str:
    """(0, 1, 2, 3, 6) → "0-3,6" (the NEURON_VISIBLE_DEVICES syntax)."""
    parts: list[str] = []
    run: list[int] = []
    for i in ids:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


# ---------------------------------------------------------------------------- rendering

def shell_command(args: tuple[str, ...], env: tuple[tuple[str, str], ...] = (),
                  program: str = "kvrelay") -> str:
    """One copy-pasteable command: env assignments, then one flag (with its values) per line."""
    words = [f"{k}={shlex.quote(v)}" for k, v in env] + [program]
    lines: list[list[str]] = [words]
    for a in args:
        if a.startswith("-") and not a.lstrip("-").isdigit():
            lines.append([shlex.quote(a)])
        else:
            lines[-1].append(shlex.quote(a))
    first, *rest = lines
    # `kvrelay serve MODEL` stays on the first line
    while rest and not rest[0][0].startswith("-"):
        first += rest.pop(0)
    return " \\\n    ".join(" ".join(line) for line in [first, *rest])


def render(plan: Plan) -> str:
    """The dry-run's report: the layout, then per host its exports and exact commands."""
    topo, cfg = plan.topology, plan.config
    out = [(f"model {plan.served_name}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} "
            f"heads, {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, hidden "
            f"{cfg.hidden_size}, {cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, "
            f"vocab {cfg.vocab_size}")]
    for spec in topo.roles:
        layout = role_layout(topo, spec)
        out.append(f"  {spec.role} × {spec.count}: {describe_layout(layout, cfg)}")
    out.append(f"layout OK: {len(plan.servers)} server(s), "
               f"{sum(len(s.devices) for s in plan.servers)} ranks"
               + (", 1 proxy" if plan.proxy else ""))
    out += [f"warning: {w}" for w in plan.warnings]
    out += KV_SECRET_NOTE
    hosts: dict[str, list[ServerPlan]] = defaultdict(list)
    for s in plan.servers:
        hosts[s.host].append(s)
    order = list(hosts) + ([plan.proxy.host] if plan.proxy and plan.proxy.host not in hosts else [])
    for host in order:
        mine = hosts.get(host, [])
        names = _names(mine) + (["proxy"] if plan.proxy and plan.proxy.host == host else [])
        out += ["", f"# ---- host {host}: {', '.join(names)}"]
        out += [f"export {k}={shlex.quote(v)}" for k, v in plan.exports]
        if mine:
            out.append(KV_SECRET_EXPORT)
        for s in mine:
            sides = (f", side channel {_span(s.side_channel_ports)}" if s.side_channel_ports
                     else "")
            out += ["",
                    f"# {s.name}: {s.layout}, devices {format_ids(s.devices)}, "
                    f"HTTP {s.port}{sides}",
                    shell_command(s.args, s.env) + " &"]
        if plan.proxy and plan.proxy.host == host:
            out += ["",
                    "# proxy: start once every server above logs \"Application startup complete\"",
                    shell_command(plan.proxy.args)]
    entry = plan.entry
    validate = ["validate", "--base-url", f"http://{entry.host}:{entry.port}", "--model",
                plan.served_name]
    if plan.proxy:
        validate.append("--expect-di")
    out += ["", "# then, from any machine that reaches it:", shell_command(tuple(validate))]
    return "\n".join(out)


def _names(servers: list[ServerPlan]) -> list[str]:
    """prefill-0 … prefill-15, decode-0: runs of a role shortened."""
    out = []
    for role in dict.fromkeys(s.role for s in servers):
        mine = [s.name for s in servers if s.role == role]
        out.append(mine[0] if len(mine) == 1 else f"{mine[0]} … {mine[-1]}" if len(mine) > 2
                   else ", ".join(mine))
    return out


def _span(ports: tuple[int, ...]) -> str:
    return str(ports[0]) if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
