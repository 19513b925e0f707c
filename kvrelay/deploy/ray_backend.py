"""`kvrelay deploy --backend ray`: the topology's servers and its proxy as detached, named Ray
actors on a running cluster, supervised and scaled by Ray.

    kvrelay deploy --backend ray --prefill 2 --decode 1 [--name NAME] [-- serve flags]
    kvrelay deploy status [--name NAME]          each server's node, URL, health and load
    kvrelay deploy scale --prefill 3 [--name NAME] [same topology flags as the deploy]
    kvrelay deploy --down [--name NAME]

Why actors that own a process, not Ray Serve: a kvrelay server is a whole serving process (its
own HTTP server, engine core, KV plane); Ray's job here is placement, restart and a shared
view, which detached actors give without a second request path in front of ours. Each
`ServerActor` starts `kvrelay serve` (or `kvrelay proxy`) on its node with the plan's
command — bound to the node's address, its side channel advertised there — and exits when
the process does, so Ray restarts it (`max_restarts`) and the process with it. Ray picks the
node from the CPUs the server asks for (its ranks); the actor pins the server to that many of
its host's cores (`claim_cores`: Ray counts CPUs, it does not pin; the plan's device ids name
one host's cores, not the node Ray picks).

The proxy's actor follows the servers: it asks each server actor of the deployment (by name,
in the deployment's namespace) where it is and whether it is ready and not draining, and
rewrites the proxy's `--backends-file` (atomically) when that changes — a restarted server on
another node, a server added or drained — so no port is typed by hand. While some server is
not ready it does not ask again and again: it waits on those servers' `wait_ready` calls,
each answered by the server's actor the moment its own look (local HTTP, WATCH_S) first sees
the server answer — as does `deploy` itself. Bring-up thus costs a few Ray calls per server,
not a stream of them on the cores the servers are starting on.

The KV secret is generated here and reaches each actor in its creation arguments (Ray keeps
them to restart it; a runtime_env would cost a fresh worker process per actor), and the
server in its environment — never a command line or a log. Anyone who can reach the Ray
cluster controls these actors (Ray has no authentication): keep the cluster's ports private.

Scale: new servers are placed and join the proxy when ready; a server scaled away is marked
draining (the proxy stops routing to it), stopped once it has nothing in flight (its own
/metrics: no request running or waiting, no KV block held), then its actor is killed.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvrelay import envs
from kvrelay.deploy.layout import KV_SECRET_ENV, Plan, ServerPlan

logger = logging.getLogger(__name__)

PROG = "kvrelay deploy"
NAMESPACE_PREFIX = "kvrelay-deploy-"
PROXY = "proxy"
POLL_S = 2.0          # the proxy actor's look at its servers once all are ready (each look
#                       is a /health call per server: fewer while they serve)
FAST_POLL_S = 0.5     # the shortest round of the follower while one is not (it waits on
#                       `wait_ready` calls; a server that was ready and is not cannot spin it)
WATCH_S = 0.1         # a server actor's look at its own server until it first answers: a
#                       local HTTP connect, no Ray call (Ray calls on the cores the servers
#                       start on slowed their start: ready 20.9-29.2 s at 0.1 s Ray polls)
WAIT_S = 15.0         # a `wait_ready` call returns after this at the latest (who is waiting)
STOP_GRACE_S = 35.0
MAX_RESTARTS = 20
IDLE_S = 1.0                 # a drained server idle this long is stopped
# environment a server must not inherit from the machine that ran `deploy`
_NOT_SHIPPED = ("NEURON_VISIBLE_DEVICES", "KVRELAY_VISIBLE_DEVICES", "RAY_ADDRESS")


def namespace(name: str) -> str:
    return NAMESPACE_PREFIX + name


def _http_json(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def with_host(args: tuple[str, ...], host: str) -> list[str]:
    """The command with `--host` set to this node's address (the plan's is one host's)."""
    out = list(args)
    if "--host" in out:
        out[out.index("--host") + 1] = host
    return out


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL when the actor's process dies (a node
    lost, `ray.kill`), so no server outlives its actor holding its ports."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def claim_cores(count: int, table: Path | None = None) -> list[int]:
    """`count` of this host's cores for the calling actor's server, the least claimed first
    (ties: the lowest id). The claims live in one locked file per host, shared by every
    actor on it (the nodes of a one-machine Ray cluster too); a claim whose process is gone
    (an actor killed, or restarted under a new process) is dropped."""
    import fcntl
    path = table or Path(tempfile.gettempdir()) / "kvrelay-ray-cores.json"
    mine = sorted(os.sched_getaffinity(0))
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            claims = {pid: cores for pid, cores in json.loads(f.read() or "{}").items()
                      if _alive(int(pid))}
        except (ValueError, AttributeError):            # not ours, or torn: start over
            claims = {}
        users = collections.Counter(c for cores in claims.values() for c in cores)
        chosen = sorted(sorted(mine, key=lambda c: (users[c], c))[:max(count, 1)])
        claims[str(os.getpid())] = chosen
        f.seek(0)
        f.truncate()
        f.write(json.dumps(claims))
    return chosen


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------ actors

class ServerActor:
    """One `kvrelay serve` / `kvrelay proxy` process on this actor's node (made remote with
    `ray.remote` at run time: Ray is an optional extra)."""

    def __init__(self, name: str, role: str, args: tuple[str, ...], port: int,
                 env: dict[str, str], log_dir: str, cpus: int = 0) -> None:
        import ray
        self.name, self.role, self.port = name, role, port
        self.ip = ray.util.get_node_ip_address()
        self.node = ray.get_runtime_context().get_node_id()
        self.draining = False
        self.stopping = False
        self.started = time.time()
        self.ready = threading.Event()       # the server answered /health once
        child_env = {k: v for k, v in os.environ.items() if k not in _NOT_SHIPPED} | env
        if role in ("prefill", "decode"):
            child_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.ip
        if cpus and "OMP_NUM_THREADS" not in env:
            # as many of this host's cores as Ray reserved CPUs for it (Ray accounts, it does
            # not pin), the least shared first — as the local deploy hands a host's cores out
            child_env["OMP_NUM_THREADS"] = str(cpus)
            if not any(a.startswith("cuda") for a in args):
                child_env[envs.VISIBLE_DEVICES.name] = ",".join(map(str, claim_cores(cpus)))
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = str(Path(log_dir) / f"{name}.log")
        command = [sys.executable, "-m", "kvrelay.cli", *with_host(args, self.ip)]
        started: list[Any] = []
        ready = threading.Event()
        threading.Thread(target=self._run, args=(command, child_env, started, ready),
                         daemon=True, name="kvrelay-server").start()
        ready.wait()
        if not started:
            raise RuntimeError(f"{name}: could not start {command[:4]}")
        self.proc: subprocess.Popen = started[0]
        threading.Thread(target=self._watch, daemon=True, name="kvrelay-ready").start()

    def _watch(self) -> None:
        """Look at the server every WATCH_S until it first answers /health (bring-up only:
        afterwards `status` calls see its health)."""
        while not self.stopping and self.proc.poll() is None:
            if _http_json(f"{self.url}/health", timeout=1.0)[0] == 200:
                self.ready.set()
                return
            time.sleep(WATCH_S)

    def wait_ready(self, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """Its status once the server first answered /health, or after `timeout_s`: one call
        that returns when there is news, instead of a poll per look."""
        self.ready.wait(timeout_s)
        return self.status(load=False)

    def _run(self, command: list[str], env: dict[str, str], started: list[Any],
             ready: threading.Event) -> None:
        """Start the server and wait for it, in one thread that lives as long as the server:
        the server's parent-death signal is tied to the thread that started it (Ray may end
        the threads that run an actor's calls)."""
        try:
            with open(self.log_path, "ab") as log:
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True, preexec_fn=_die_with_parent)
            started.append(proc)
        finally:
            ready.set()
        proc.wait()
        if not self.stopping:
            os._exit(1)              # the actor dies with its process: Ray restarts both

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def status(self, load: bool = True) -> dict[str, Any]:
        """Where it runs and whether it is ready; with `load`, its counters too (the proxy's
        follower leaves them out: it asks every POLL_S, FAST_POLL_S while one is not ready)."""
        health, _ = _http_json(f"{self.url}/health")
        _, metrics = _http_json(f"{self.url}/metrics") if health == 200 and load else (0, "")
        return {"name": self.name, "role": self.role, "node": self.node, "ip": self.ip,
                "url": self.url, "pid": self.proc.pid, "started": self.started,
                "ready": health == 200, "draining": self.draining,
                "running": _metric(metrics, "vllm:num_requests_running"),
                "waiting": _metric(metrics, "vllm:num_requests_waiting"),
                "kv_blocks": _metric(metrics, "kvrelay:kv_blocks_used"),
                "log": self.log_path}

    def drain(self) -> None:
        self.draining = True

    def stop(self) -> int | None:
        """SIGTERM the process group (a server drains for up to 30 s), then SIGKILL."""
        self.stopping = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


class ProxyActor(ServerActor):
    """`kvrelay proxy` fed by the deployment's server actors through `--backends-file`."""

    def __init__(self, args: tuple[str, ...], port: int, env: dict[str, str], log_dir: str,
                 ns: str, settings: dict[str, Any]) -> None:
        self.ns, self.settings, self.env = ns, settings, env
        self.backends_path = str(Path(tempfile.mkdtemp(prefix="kvrelay-backends-")) /
                                 "backends.json")
        self.written: dict[str, Any] | None = None
        self._write({"prefill": [], "decode": []})     # the servers join as they get ready
        super().__init__(PROXY, PROXY, tuple(args) + ("--backends-file", self.backends_path),
                         port, env, log_dir)
        threading.Thread(target=self._follow, daemon=True, name="kvrelay-backends").start()

    def deployment(self) -> tuple[dict[str, Any], dict[str, str]]:
        """What `scale` needs to place more servers like these: the topology settings and
        the environment (the KV secret) every server gets."""
        return self.settings, self.env

    def _follow(self) -> None:
        """Write the backends file anew whenever the servers' states change: every POLL_S
        while all are ready; while some are not (bring-up, a restart, a scale step), as soon
        as one of them is (their `wait_ready`), at most every FAST_POLL_S."""
        while not self.stopping:
            t0 = time.monotonic()
            try:
                waiting = self._write_backends()
                if waiting:
                    self._await_one(waiting)
            except Exception as e:                  # a server actor restarting: next round
                logger.debug("backends: %s", e)
                waiting = ["?"]
            pause = POLL_S if not waiting else FAST_POLL_S - (time.monotonic() - t0)
            if pause > 0:
                time.sleep(pause)

    def _await_one(self, names: list[str]) -> None:
        """Until one of these servers is ready (or POLL_S passed)."""
        import ray
        refs = [server_handle(n, self.ns).wait_ready.remote(POLL_S) for n in names]
        ray.wait(refs, num_returns=1, timeout=POLL_S + 1)

    def _write_backends(self) -> list[str]:
        """The file anew if the ready servers changed; the servers not (known to be) ready."""
        import ray
        names = server_names(self.ns)
        refs = [server_handle(n, self.ns).status.remote(False) for n in names]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=5) if refs else ([], [])
        states = {}
        for ref in answered:        # an actor Ray is restarting is left out until it is back
            try:
                st = ray.get(ref)
                states[st["name"]] = st
            except Exception as e:
                logger.debug("backends: %s", e)
        out: dict[str, Any] = {"prefill": [], "decode": []}
        for st in sorted(states.values(), key=lambda s: s["name"]):
            if st["role"] in out and st["ready"] and not st["draining"]:
                out[st["role"]].append({"id": st["name"], "url": st["url"]})
        if out != self.written:
            self._write(out)
        return [n for n in names if n not in states or not states[n]["ready"]]

    def _write(self, backends: dict[str, Any]) -> None:
        tmp = self.backends_path + ".tmp"
        Path(tmp).write_text(json.dumps(backends))
        os.replace(tmp, self.backends_path)             # the proxy never reads half a file
        self.written = backends


def server_names(ns: str) -> list[str]:
    import ray
    return [n for n in _actor_names(ray, ns) if n != PROXY]


def server_handle(name: str, ns: str) -> Any:
    import ray
    return ray.get_actor(name, namespace=ns)


# ------------------------------------------------------------------------------ commands

def call(ray: Any, method: Any, *args: Any, timeout_s: float = 90) -> Any:
    """`method.remote(*args)`, waited for; an actor that Ray is restarting (its node lost,
    its process died) is asked again until `timeout_s`."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(method.remote(*args), timeout=max(deadline - time.monotonic(), 1))
        except (ActorUnavailableError, RayActorError, GetTimeoutError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _connect(address: str | None) -> Any:
    from kvrelay.distributed.ray_cluster import connect
    return connect(address, log_to_driver=False)     # the servers log to files on their nodes


def _server_env(plan: Plan, server: ServerPlan, secret: str) -> dict[str, str]:
    env = dict(plan.exports) | dict(server.env) | {KV_SECRET_ENV: secret}
    return {k: v for k, v in env.items() if k not in _NOT_SHIPPED}


def _place(ray: Any, cls: type, name: str, ns: str, cpus: int, *args: Any) -> Any:
    """A detached named actor (it outlives `deploy`), spread over the nodes, restarted by
    Ray when it dies; a few concurrent calls (status while it stops or while `deploy` and the
    proxy's follower wait on `wait_ready`)."""
    return ray.remote(cls).options(
        name=name, namespace=ns, lifetime="detached", max_restarts=MAX_RESTARTS,
        max_task_retries=0, num_cpus=cpus, max_concurrency=8,
        scheduling_strategy="SPREAD").remote(*args)


def start_servers(ray: Any, plan: Plan, servers: list[ServerPlan], ns: str, secret: str,
                  log_dir: str) -> list[Any]:
    from kvrelay.distributed.ray_cluster import cpus_per_worker
    out = []
    for s in servers:
        cpus = len(s.devices) * cpus_per_worker()
        out.append(_place(ray, ServerActor, s.name, ns, cpus, s.name, s.role, s.args, s.port,
                          _server_env(plan, s, secret), log_dir, cpus))
    return out


def await_actors(ray: Any, handles: list[Any], timeout_s: float) -> None:
    """Until every actor has been created (its server process started) or `timeout_s`."""
    ray.wait([h.__ray_ready__.remote() for h in handles], num_returns=len(handles),
             timeout=timeout_s)


def await_ready(ray: Any, handles: list[Any], timeout_s: float,
                say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every handle's status once all are ready (in order); TimeoutError naming those that
    are not. One `wait_ready` call per server at a time, answered when it is ready or after
    WAIT_S (then it says who is still starting and asks again)."""
    deadline = time.monotonic() + timeout_s
    states: dict[int, dict[str, Any]] = {}
    pending = {h.wait_ready.remote(WAIT_S): i for i, h in enumerate(handles)}
    last: dict[int, dict[str, Any]] = {}
    said = time.monotonic()
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            waiting = [last[i]["name"] if i in last else f"server {i}" for i in pending.values()]
            raise TimeoutError(f"not ready after {timeout_s:.0f}s: {', '.join(waiting)}")
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, WAIT_S + 5))
        for ref in done:
            i = pending.pop(ref)
            try:
                st = ray.get(ref)
            except Exception as e:               # an actor restarting after a failed start
                logger.debug("wait_ready: %s", e)
                time.sleep(0.5)
                st = None
            if st is not None and st["ready"]:
                states[i] = st
                continue
            if st is not None:
                last[i] = st
            pending[handles[i].wait_ready.remote(WAIT_S)] = i
        if pending and time.monotonic() - said >= WAIT_S:
            say("waiting for " + ", ".join(f"{last[i]['name']} on {last[i]['ip']}"
                                            for i in pending.values() if i in last))
            said = time.monotonic()
    return [states[i] for i in range(len(handles))]


def up(plan: Plan, args: argparse.Namespace, settings: dict[str, Any],
       say: Callable[[str], None]) -> int:
    """Place the topology and its proxy; return once the proxy answers (deploy exits; the
    actors live on: `kvrelay deploy --down` stops them)."""
    if not plan.proxy:
        say("error: --backend ray places disaggregated topologies (prefill + decode + proxy); "
            "a single instance is `kvrelay serve --distributed-executor-backend ray`")
        return 2
    ray = _connect(args.ray_address)
    ns = namespace(args.name)
    existing = _actor_names(ray, ns)
    if existing:
        say(f"error: deployment {args.name!r} already runs on this cluster ({len(existing)} "
            f"actors); `kvrelay deploy --down --name {args.name}` first, or choose --name")
        return 1
    t0, wall0 = time.monotonic(), time.time()
    log_dir = str(args.log_dir or Path(tempfile.gettempdir()) / f"kvrelay-deploy-{args.name}")
    secret = secrets.token_hex(32)
    handles = start_servers(ray, plan, list(plan.servers), ns, secret, log_dir)
    say(f"placed {len(handles)} server(s) on the Ray cluster (namespace {ns}); KV secret in "
        f"their environment (not shown); logs on each node in {log_dir}")
    timeout = float(args.engine_ready_timeout or envs.ENGINE_READY_TIMEOUT_S.as_float() or 600)
    try:
        # the proxy once the servers' actors exist (their processes are starting): its
        # actor's start (a Python worker importing Ray) then does not delay theirs, and it
        # is up long before they are — it answers 503 until its backends file lists them,
        # and lists each as soon as it is ready
        await_actors(ray, handles, 60)
        proxy_env = {KV_SECRET_ENV: secret} | dict(plan.exports)
        proxy = _place(ray, ProxyActor, PROXY, ns, 1, proxy_command(plan), plan.proxy.port,
                       proxy_env, log_dir, ns, settings)
        *states, proxy_state = await_ready(ray, handles + [proxy], timeout + 15, say)
        ready_s = time.monotonic() - t0
        await_backends(proxy_state["url"], len(plan.role_servers("prefill")),
                       len(plan.role_servers("decode")), 120)
    except Exception as e:
        say(f"error: {e}; stopping what was placed")
        down(args.name, args.ray_address, say)
        return 1
    started = max(s["started"] for s in states) - wall0
    say(f"ready in {time.monotonic() - t0:.1f}s (Ray had started the servers' processes at "
        f"{started:.1f}s; they were ready at {ready_s:.1f}s)")
    for s in states + [proxy_state]:
        say(f"  {s['name']:<10} {s['url']}  node {s['node'][:8]}  (log {s['log']})")
    say(f"OpenAI base URL: {proxy_state['url']}/v1 (model {plan.served_name}). "
        f"`kvrelay deploy --down --name {args.name}` stops it.")
    return 0


def proxy_command(plan: Plan) -> tuple[str, ...]:
    """The plan's proxy command without its backend flags: the backends file replaces them."""
    assert plan.proxy is not None
    out, skip = [], False
    for a in plan.proxy.args:
        if a.startswith("--prefiller-") or a.startswith("--decoder-"):
            skip = True
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return tuple(out)


def await_backends(proxy_url: str, prefill: int, decode: int, timeout_s: float) -> None:
    """Until the proxy reports that many active backends per role (its /metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, text = _http_json(f"{proxy_url}/metrics")
        got = {role: _metric(text, f'kvrelay_proxy:backends{{role="{role}",state="active"}}')
               for role in ("prefill", "decode")}
        if code == 200 and got["prefill"] >= prefill and got["decode"] >= decode:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the proxy has {got} active backends after {timeout_s:.0f}s, "
                               f"expected {prefill} prefill and {decode} decode")
        time.sleep(0.1)                 # an HTTP GET: the servers are up by now


def _actor_names(ray: Any, ns: str) -> list[str]:
    """Every actor of the deployment (its servers and its proxy)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == ns)


def _deployment(name: str, address: str | None,
                say: Callable[[str], None]) -> tuple[Any, str, list[str]]:
    """(ray, namespace, actor names) of deployment `name`; no names: it says so."""
    ray = _connect(address)
    ns = namespace(name)
    names = _actor_names(ray, ns)
    if not names:
        say(f"no deployment {name!r} on this cluster")
    return ray, ns, names


def down(name: str, address: str | None, say: Callable[[str], None]) -> int:
    ray, ns, names = _deployment(name, address, say)
    if not names:
        return 0
    order = ([PROXY] if PROXY in names else []) + sorted(n for n in names if n != PROXY)
    for n in order:                          # the proxy first: no new request reaches a server
        handle = ray.get_actor(n, namespace=ns)
        try:
            ray.get(handle.stop.remote(), timeout=STOP_GRACE_S + 10)
        except Exception as e:
            logger.debug("stop %s: %s", n, e)
        ray.kill(handle, no_restart=True)
    say(f"stopped {len(order)} actor(s) of deployment {name!r}: {', '.join(order)}")
    return 0


def status(name: str, address: str | None, say: Callable[[str], None],
           out: TextIO = sys.stdout) -> int:
    ray, ns, names = _deployment(name, address, say)
    if not names:
        return 1
    states = [call(ray, ray.get_actor(n, namespace=ns).status, timeout_s=30) for n in names]
    out.write(f"{'name':<10} {'node':<9} {'url':<24} {'health':<9} running waiting kv_blocks\n")
    for s in states:
        health = "draining" if s["draining"] else ("ready" if s["ready"] else "starting")
        out.write(f"{s['name']:<10} {s['node'][:8]:<9} {s['url']:<24} {health:<9} "
                  f"{s['running']:>7.0f} {s['waiting']:>7.0f} {s['kv_blocks']:>9.0f}\n")
    return 0 if all(s["ready"] for s in states) else 1


def scale(plan_for: Callable[[dict[str, Any]], Plan], args: argparse.Namespace,
          say: Callable[[str], None]) -> int:
    """Add servers of a role (placed, then joined by the proxy when ready) or drain the
    highest-numbered ones away."""
    ray = _connect(args.ray_address)
    ns = namespace(args.name)
    try:
        proxy = ray.get_actor(PROXY, namespace=ns)
    except ValueError:
        say(f"error: no deployment {args.name!r} on this cluster")
        return 1
    settings, env = call(ray, proxy.deployment)
    secret = env[KV_SECRET_ENV]
    for role in ("prefill", "decode"):
        want = getattr(args, role)
        if want is None:
            continue
        if want < 1:
            say(f"error: --{role} must be ≥ 1 (a topology needs both roles)")
            return 2
        have = [n for n in server_names(ns) if n.startswith(f"{role}-")]
        settings = dict(settings) | {role: dict(settings.get(role, {})) | {"count": want}}
        plan = plan_for(settings)
        planned = {s.name: s for s in plan.role_servers(role)}
        added = [planned[n] for n in sorted(planned) if n not in have]
        removed = [n for n in have if n not in planned]
        if added:
            log_dir = str(args.log_dir or Path(tempfile.gettempdir()) /
                          f"kvrelay-deploy-{args.name}")
            handles = start_servers(ray, plan, added, ns, secret, log_dir)
            await_ready(ray, handles, 600, say)
            say(f"{role}: added {', '.join(s.name for s in added)}")
        proxy_url = call(ray, proxy.status)["url"]
        for n in reversed(removed):
            _drain_and_stop(ray, n, ns, proxy_url, say)
    return 0


def _drain_and_stop(ray: Any, name: str, ns: str, proxy_url: str, say: Callable[[str], None],
                    timeout_s: float = 300) -> None:
    """Drain: the proxy stops routing to it and lets go of it once nothing it routed there is
    in flight (a prefill: until its decodes have pulled the KV); then the server's own
    counters must show nothing either, for IDLE_S (a request routed just before); then stop."""
    handle = ray.get_actor(name, namespace=ns)
    call(ray, handle.drain)
    deadline = time.monotonic() + timeout_s
    held = f'id="{name}"'
    while time.monotonic() < deadline:
        _, text = _http_json(f"{proxy_url}/metrics")
        if text and not any(line.startswith("kvrelay_proxy:backend_info{") and held in line
                            for line in text.splitlines()):
            break
        time.sleep(0.25)
    idle_since = None
    while time.monotonic() < deadline:
        s = call(ray, handle.status)
        if s["running"] or s["waiting"] or s["kv_blocks"]:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= IDLE_S:
            break
        time.sleep(0.25)
    call(ray, handle.stop, timeout_s=STOP_GRACE_S + 10)
    ray.kill(handle, no_restart=True)
    say(f"drained and stopped {name}")
