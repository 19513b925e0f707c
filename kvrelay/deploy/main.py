"""`kvrelay deploy`: stand up a single instance, 1P1D or xPyD on this machine with one command,
or print (`--dry-run`) every process's exact command and environment for any machines.

    kvrelay deploy --model DIR --prefill 2 --decode 1 -- --max-model-len 4096
    kvrelay deploy --config topo.yaml
    kvrelay deploy --model openai/gpt-oss-120b --prefill 16 --prefill-tp 4 \\
        --decode 1 --decode-tp 8 --decode-dp 8 --enable-expert-parallel --devices 0-63 \\
        --hosts prefill=PREFILL_HOST decode=DECODE_HOST --dry-run
    kvrelay deploy --prefill 2 --decode 1 --emit k8s --k8s-image IMAGE --k8s-model-pvc PVC

Steps: check the layout against the model's config (plan.py), generate the topology's KV
secret (`KVRELAY_KV_SECRET` for every server; shown nowhere), start the decode and prefill
servers at once, await each one's "Application startup complete" (saying which step each
one is at: starting, loading the weights, warming up, ready …), start the proxy, run
`kvrelay validate` against it, print the endpoints, then supervise: a process that exits is
restarted with backoff (`--no-restart`: everything stops instead, exit 1). On SIGINT/SIGTERM
stop everything it started. Exit status: 0 after a signal, 1 when something failed (the
failing component's log tail is shown and the rest are stopped), 2 for bad flags.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from kvrelay import envs
from kvrelay.cli_flags import HelpFormatter
from kvrelay.deploy import k8s
from kvrelay.deploy.layout import (
    KV_SECRET_ENV,
    Plan,
    describe_layout,
    format_ids,
    make_plan,
    render,
    role_layout,
)
from kvrelay.deploy.shapes import TUTORIAL, model_config
from kvrelay.deploy.topology import (
    PRESETS,
    Ports,
    TopologyError,
    load_yaml,
    merge_settings,
    ports_from_flags,
    topology_from_settings,
)

if TYPE_CHECKING:
    from kvrelay.deploy.launcher import Deployment

PROG = "kvrelay deploy"
logger = logging.getLogger("kvrelay.deploy")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, usage=f"{PROG} [flags] [-- serve flags for every server]",
                description="Stand up a kvrelay topology on this machine, or print its commands "
                            "(--dry-run).\nEvery flag: docs/deploy.md. Unset flags take the "
                            "--config file's value, else the default shown.",
                formatter_class=HelpFormatter)
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="topology YAML (flags given here override it; default: none)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, or openai/gpt-oss-120b | openai/gpt-oss-20b "
                        "(built-in configs for --dry-run); default: the embedded model")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="passed to every server; validate uses it (default: the model as given)")
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill servers (kv_producer; default: none: without --prefill and "
                        "--decode, a single instance)")
    p.add_argument("--decode", type=int, default=None, metavar="N",
                   help="decode servers (kv_consumer; default: none, a single instance)")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="TP size of each prefill server (default: 1)")
    p.add_argument("--prefill-dp", type=int, default=None, metavar="N",
                   help="DP size of each prefill server (default: 1)")
    p.add_argument("--prefill-ep-degree", type=int, default=None, metavar="N",
                   help="neuron_config.ep_degree of the prefill servers (default: 2 with the "
                        "tutorial preset when the prefill TP is even and EP is on, else none)")
    p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                   help="TP size of each decode server (default: 1)")
    p.add_argument("--decode-dp", type=int, default=None, metavar="N",
                   help="DP size of each decode server (default: 1)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="single instance (no --prefill/--decode): its TP size (default: 1)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                   help="single instance: its DP size (default: 1)")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="--enable-expert-parallel on every server (default: off)")
    p.add_argument("--port", type=int, default=None, metavar="P",
                   help="where clients connect: the proxy's port, or a single instance's "
                        f"(default: {Ports.proxy})")
    p.add_argument("--base-port", type=int, default=None, metavar="P",
                   help="the servers behind the proxy: prefill P+100…, decode P+200… (default: "
                        f"{Ports.prefill - 100}: {Ports.prefill}/{Ports.decode}); the proxy stays "
                        "on --port")
    p.add_argument("--side-channel-port", type=int, default=None, metavar="P",
                   help="KV side channels: prefill P…, decode P+100… (default: "
                        f"{Ports.prefill_side_channel}: {Ports.prefill_side_channel}/"
                        f"{Ports.decode_side_channel})")
    p.add_argument("--devices", default=None, metavar="IDS",
                   help="device ids of each host, e.g. 0-63 (default: this machine's CPU cores)")
    p.add_argument("--hosts", nargs="+", default=None, metavar="ROLE=HOST[,HOST]",
                   help="hosts per role (prefill, decode, single, proxy) for --dry-run layouts "
                        "across machines (default: 127.0.0.1 for every role)")
    p.add_argument("--proxy-args", default=None, metavar="'FLAGS'",
                   help="flags for the proxy, one string (e.g. '--routing cache_aware "
                        "--disagg-policy auto'; default: none)")
    p.add_argument("--connector", choices=("nixl", "tcp"), default=None,
                   help="KV transport (default: nixl)")
    p.add_argument("--kv-backend", default=None, metavar="NAME",
                   help="NIXL backend (default: UCX; LIBFABRIC with --preset tutorial)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="tutorial: the tutorial's serve flags and neuron_config (default: "
                        "tutorial for the built-in ids, else none)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="where each process logs (default: a new temp dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the topology and print every command; start nothing")
    p.add_argument("--no-validate", action="store_true",
                   help="skip `kvrelay validate` once everything is up")
    p.add_argument("--no-restart", action="store_true",
                   help="when a process exits, stop everything (default: restart it with backoff)")
    p.add_argument("--validate-requests", type=int, default=16, metavar="N",
                   help="requests of validate's traffic check")
    p.add_argument("--validate-timeout", type=float, default=300.0, metavar="S",
                   help="seconds validate allows each request")
    p.add_argument("--engine-ready-timeout", type=float, default=None, metavar="S",
                   help="seconds each server may take to be ready (default: "
                        f"{envs.ENGINE_READY_TIMEOUT_S.shown})")
    k8s.add_flags(p)
    add_ray_flags(p)
    return p


def add_ray_flags(p: argparse.ArgumentParser, scale: bool = False) -> None:
    g = p.add_argument_group("Ray (docs/cluster.md)")
    if not scale:
        g.add_argument("--backend", choices=("local", "ray"), default="local",
                       help="local: processes on this machine (default); ray: detached actors "
                            "on a running Ray cluster, restarted by Ray and scalable in place")
        g.add_argument("--down", action="store_true",
                       help="--backend ray: stop the deployment NAME and remove its actors")
    g.add_argument("--name", default="kvrelay", metavar="NAME",
                   help="the deployment's name on the Ray cluster (default kvrelay)")
    g.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="the Ray cluster (default $RAY_ADDRESS, else a cluster on this host)")


def flag_settings(args: argparse.Namespace, serve_args: list[str]) -> dict[str, Any]:
    """The flags given, in the YAML schema (absent flags leave the file's values alone)."""
    s: dict[str, Any] = {k: v for k, v in {
        "model": args.model, "served_model_name": args.served_model_name, "preset": args.preset,
        "connector": args.connector, "kv_backend": args.kv_backend, "devices": args.devices,
        "hosts": args.hosts}.items() if v is not None}
    ports = ports_from_flags(args.port, args.base_port, args.side_channel_port)
    if ports:
        s["ports"] = ports
    roles = {
        "prefill": {"count": args.prefill, "tp": args.prefill_tp, "dp": args.prefill_dp,
                    "ep_degree": args.prefill_ep_degree},
        "decode": {"count": args.decode, "tp": args.decode_tp, "dp": args.decode_dp},
        "single": {"tp": args.tensor_parallel_size, "dp": args.data_parallel_size},
    }
    for role, values in roles.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            s[role] = given
    if serve_args:
        s["serve_args"] = list(serve_args)
    if args.proxy_args is not None:
        s["proxy_args"] = shlex.split(args.proxy_args)
    return s


def build_plan(args: argparse.Namespace, serve_args: list[str]) -> Plan:
    return plan_from_settings(merged_settings(args, serve_args))


def merged_settings(args: argparse.Namespace, serve_args: list[str]) -> dict[str, Any]:
    """The topology in the YAML schema: the file's settings, then the command line's."""
    settings = load_yaml(args.config) if args.config else {}
    flags = flag_settings(args, serve_args)
    if "serve_args" in settings and "serve_args" in flags:
        flags["serve_args"] = list(settings["serve_args"]) + flags["serve_args"]
    settings = merge_settings(settings, flags)
    if args.enable_expert_parallel:
        _enable_expert_parallel(settings)
    return settings


def plan_from_settings(settings: dict[str, Any]) -> Plan:
    model = settings.get("model")
    served = settings.get("served_model_name")
    default_preset = "tutorial" if model in TUTORIAL or served in TUTORIAL else "none"
    topo = topology_from_settings(settings, default_preset)
    try:
        cfg = model_config(topo.model, topo.served_model_name)
    except ValueError as e:
        raise TopologyError([str(e)]) from None
    return make_plan(topo, cfg)


def _enable_expert_parallel(settings: dict[str, Any]) -> None:
    """--enable-expert-parallel: on every role the topology has (a single instance if none)."""
    roles = [r for r in ("single", "prefill", "decode")
             if isinstance(settings.get(r), dict)] or ["single"]
    for role in roles:
        settings[role] = dict(settings.get(role) or {}, enable_expert_parallel=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["status"], ["scale"]):
        return _ray_command(argv[0], argv[1:])
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    problem = k8s.flag_problem(args)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    if args.down:
        from kvrelay.deploy import ray_backend
        return _one_line(lambda: ray_backend.down(args.name, args.ray_address, _say))
    try:
        settings = merged_settings(args, serve_args)
        plan = plan_from_settings(settings)
    except TopologyError as e:
        print(f"{PROG}: error: invalid topology:", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    if args.emit:
        return k8s.emit(plan, args)
    if args.dry_run:
        try:
            print(render(plan), flush=True)
        except BrokenPipeError:               # `| head`: the reader left; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.backend == "ray":
        from kvrelay.deploy import ray_backend
        return _one_line(lambda: ray_backend.up(plan, args, settings, _say))
    return launch(plan, args)


def _ray_command(command: str, argv: list[str]) -> int:
    """`kvrelay deploy status` / `kvrelay deploy scale --prefill N --decode N`."""
    from kvrelay.deploy import ray_backend
    p = _Parser(prog=f"{PROG} {command}", formatter_class=HelpFormatter)
    add_ray_flags(p, scale=True)
    if command == "scale":
        p.add_argument("--prefill", type=int, default=None, metavar="N",
                       help="prefill servers wanted (added, or the last ones drained away)")
        p.add_argument("--decode", type=int, default=None, metavar="N",
                       help="decode servers wanted")
        p.add_argument("--log-dir", type=Path, default=None, metavar="DIR")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if command == "status":
        return _one_line(lambda: ray_backend.status(args.name, args.ray_address, _say))
    if args.prefill is None and args.decode is None:
        p.error("say how many: --prefill N and/or --decode N")
    return _one_line(lambda: ray_backend.scale(plan_from_settings, args, _say))


def _one_line(run: Callable[[], int]) -> int:
    """Ray commands: a cluster that cannot be joined (or a bad layout) is one line, exit 1.
    The command leaves the cluster itself once done (the actors are detached): left to the
    interpreter's exit, Ray's teardown took ~1 s more (0.28 s this way)."""
    try:
        return run()
    except (ConnectionError, ValueError, TopologyError) as e:
        text = "; ".join(e.problems) if isinstance(e, TopologyError) else str(e)
        print(f"{PROG}: error: {text}", file=sys.stderr)
        return 1
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


# ---------------------------------------------------------------------------- launching

def launch(plan: Plan, args: argparse.Namespace) -> int:
    from kvrelay.deploy.launcher import DeployFailure, Deployment, ports_in_use
    if not plan.topology.local:
        print(f"{PROG}: error: hosts other than this machine ({', '.join(_hosts(plan))}): deploy "
              "starts processes here only; use --dry-run and run the printed commands on each "
              "host", file=sys.stderr)
        return 1
    busy = ports_in_use(plan)
    if busy:
        print(f"{PROG}: error: " + "; ".join(busy) + " (choose others with --port / "
                                                     "--base-port / --side-channel-port)",
              file=sys.stderr)
        return 1
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvrelay-deploy-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _print_summary(plan, log_dir)
    timeout = _ready_timeout(plan, args)
    if args.engine_ready_timeout is not None:
        plan = _with_export(plan, "VLLM_ENGINE_READY_TIMEOUT_S", f"{args.engine_ready_timeout:g}")
    stop = threading.Event()
    deployment = Deployment(plan, log_dir, kv_secret=secrets.token_hex(32))
    previous = _install_handlers(stop, deployment)
    try:
        rc = _run(plan, args, deployment, stop, timeout)
    except DeployFailure as e:
        _say(f"error: {e}")
        rc = 1
    finally:
        deployment.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say(f"stopped {len(deployment.components)} process(es); logs in {log_dir}")
    return rc


def _run(plan: Plan, args: argparse.Namespace, deployment: Deployment, stop: threading.Event,
         timeout: float) -> int:
    """Start, await, validate, then wait for a signal (0) or a component's death (1)."""
    t0 = time.monotonic()
    servers = deployment.start_servers()
    _say("started " + ", ".join(f"{c.name} (pid {c.pid})" for c in servers))
    if not deployment.await_ready(servers, timeout, stop, _say):
        return 0
    _say(f"{len(servers)} server(s) ready in {time.monotonic() - t0:.1f}s")
    if plan.proxy:
        proxy = deployment.start_proxy()
        _say(f"started proxy (pid {proxy.pid})")
        if not deployment.await_ready([proxy], timeout, stop, _say):
            return 0
    if not args.no_validate and not _validate(plan, args, stop):
        if stop.is_set():
            return 0
        _say("validation failed: stopping (--no-validate starts a deployment without it)")
        return 1
    _print_endpoints(plan, deployment, time.monotonic() - t0)
    if not args.no_restart:
        deployment.supervise(stop, _say)
        return 0
    died = deployment.watch(stop)
    if died is None:
        return 0
    _say(f"{died.name} exited with status {died.poll()}; stopping the rest. Last lines of "
         f"{died.log_path}:\n{died.tail()}")
    return 1


def _install_handlers(stop: threading.Event, deployment: Deployment) -> dict[int, Any]:
    def handler(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            deployment.force.set()          # a second Ctrl-C: no more waiting for drains
        stop.set()
        _say(f"{signal.Signals(signum).name}: stopping everything")
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _validate(plan: Plan, args: argparse.Namespace, stop: threading.Event) -> bool:
    """`kvrelay validate` against the entry point, in a thread so a signal is not held up by it."""
    from kvrelay.deploy.validate import ValidateOptions, run_checks
    entry = plan.entry
    options = ValidateOptions(
        base_url=f"http://{entry.host}:{entry.port}", model=plan.served_name,
        expect_di=plan.proxy is not None,
        decode_urls=tuple(s.url for s in plan.role_servers("decode")),
        prefill_urls=tuple(s.url for s in plan.role_servers("prefill")),
        num_requests=args.validate_requests, timeout=args.validate_timeout,
        api_key=envs.PROXY_API_KEY.raw() if plan.proxy else None)
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(run_checks(options)), daemon=True,
                              name="kvrelay-validate")
    worker.start()
    while worker.is_alive() and not stop.is_set():
        worker.join(0.25)
    if stop.is_set():
        return False
    for r in results:
        _say(f"validate: {r.line()}")
    return bool(results) and all(r.ok for r in results)


def _ready_timeout(plan: Plan, args: argparse.Namespace) -> float:
    """The servers' own engine-ready limit plus a margin, so a server says why it gave up first."""
    if args.engine_ready_timeout is not None:
        return args.engine_ready_timeout + 15
    exported = dict(plan.exports).get("VLLM_ENGINE_READY_TIMEOUT_S")
    return float(exported or envs.ENGINE_READY_TIMEOUT_S.as_float() or 600) + 15


def _with_export(plan: Plan, name: str, value: str) -> Plan:
    from dataclasses import replace
    return replace(plan,
                   exports=tuple(kv for kv in plan.exports if kv[0] != name) + ((name, value),))


def _hosts(plan: Plan) -> list[str]:
    return sorted({s.host for s in plan.servers} | ({plan.proxy.host} if plan.proxy else set()))


def _print_summary(plan: Plan, log_dir: Path) -> None:
    topo = plan.topology
    for spec in topo.roles:
        _say(f"{spec.role} × {spec.count}: {describe_layout(role_layout(topo, spec), plan.config)}")
    for w in plan.warnings:
        _say(f"warning: {w}")
    _say(f"KV secret: a new one for this topology, in every server's {KV_SECRET_ENV} (not shown)")
    _say(f"starting {len(plan.servers)} server(s){' and the proxy' if plan.proxy else ''}; logs in "
         f"{log_dir}")


def _print_endpoints(plan: Plan, deployment: Deployment, seconds: float) -> None:
    logs = {c.name: c.log_path for c in deployment.components}
    _say(f"ready in {seconds:.1f}s")
    if plan.proxy:
        _say(f"  proxy      {plan.proxy.url}  (log {logs['proxy']})")
    for s in plan.servers:
        ports = ",".join(map(str, s.side_channel_ports))
        side = f"  side channel {ports}" if s.side_channel_ports else ""
        _say(f"  {s.name:<10} {s.url}  {s.layout}, devices {format_ids(s.devices)}{side}  (log "
             f"{logs[s.name]})")
    _say(f"OpenAI base URL: {plan.entry.url}/v1 (model {plan.served_name}). Ctrl-C stops "
         "everything.")


def _say(text: str) -> None:
    print(f"{PROG}: {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
