"""The actors of `kvrelay deploy --backend ray` (kvrelay/deploy/ray_backend.py places them):
each `ServerActor` owns one `kvrelay serve` / `kvrelay proxy` process on its node.

Why actors that own a process, not Ray Serve: a kvrelay server is a whole serving process (its
own HTTP server, engine core, KV plane); Ray's job here is placement, restart and a shared
view, which detached actors give without a second request path in front of ours. Each
`ServerActor` starts its command on its node — bound to the node's address, its side channel
advertised there — and exits when the process does, so Ray restarts it (`max_restarts`) and
the process with it. Ray picks the node from the CPUs the server asks for (its ranks); the
actor pins the server to that many of its host's cores (`claim_cores`: Ray counts CPUs, it
does not pin; the plan's device ids name one host's cores, not the node Ray picks).

The proxy's actor follows the servers: it asks each server actor of the deployment (by name,
in the deployment's namespace) where it is and whether it is ready and not draining, and
rewrites the proxy's `--backends-file` (atomically) when that changes — a restarted server on
another node, a server added or drained — so no port is typed by hand. While some server is
not ready it does not ask again and again: it waits on those servers' `wait_ready` calls,
each answered by the server's actor the moment it sees its server ready — as does `deploy`
itself, which also hears each step a server reaches (loading the weights, warming up …), as
the local deploy says them. A server actor learns both from the server's log (the local
launcher's `log_steps`), and asks the server over HTTP once, when its log says it is ready:
bring-up costs a few Ray calls per server and no requests to the servers while they start
on the same cores.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvrelay import envs
from kvrelay.deploy.log_steps import READY_STEP, STARTING, LogSteps

logger = logging.getLogger(__name__)

PROXY = "proxy"
POLL_S = 2.0          # the proxy actor's look at its servers once all are ready (each look
#                       is a /health call per server: fewer while they serve)
FAST_POLL_S = 0.5     # the shortest round of the follower while one is not (it waits on
#                       `wait_ready` calls; a server that was ready and is not cannot spin it)
WATCH_S = 0.1         # a server actor's look at its server's log until the server is ready
#                       (no Ray call, no HTTP: Ray calls on the cores the servers start on
#                       slowed their start, ready 20.9-29.2 s at 0.1 s Ray polls)
WAIT_S = 15.0         # a `wait_ready` call returns after this at the latest (who is waiting)
STOP_GRACE_S = 35.0
# environment a server must not inherit from the machine that ran `deploy`
NOT_SHIPPED = ("NEURON_VISIBLE_DEVICES", "KVRELAY_VISIBLE_DEVICES", "RAY_ADDRESS")


def http_json(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def metric(text: str, name: str) -> float:
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
        self.step = STARTING                  # what its log says it is doing (log_steps)
        self.changed = threading.Condition()  # `step` or `ready` changed
        child_env = {k: v for k, v in os.environ.items() if k not in NOT_SHIPPED} | env
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
        self.log_offset: int = started[1]
        threading.Thread(target=self._watch, daemon=True, name="kvrelay-ready").start()

    def _watch(self) -> None:
        """Follow the server's steps in its log every WATCH_S until it is ready; then (and
        only then) ask /health — every WATCH_S until it answers, as a proxy does once it has
        servers (bring-up only: afterwards `status` calls see its health)."""
        steps = LogSteps(Path(self.log_path), self.log_offset)
        while not self.stopping and self.proc.poll() is None:
            if not steps.ready and steps.update():
                self._note(step=steps.step)
            if steps.ready and http_json(f"{self.url}/health", timeout=1.0)[0] == 200:
                self._note(ready=True)
                return
            time.sleep(WATCH_S)

    def _note(self, step: str | None = None, ready: bool = False) -> None:
        with self.changed:
            if step is not None:
                self.step = step
            if ready:
                self.ready.set()
            self.changed.notify_all()

    def wait_ready(self, timeout_s: float = WAIT_S, step: str | None = None) -> dict[str, Any]:
        """Its status once the server is ready — or, given the `step` the caller last saw,
        once it moves on from that step — or after `timeout_s`: one call that returns when
        there is news, instead of a poll per look."""
        with self.changed:
            self.changed.wait_for(lambda: self.ready.is_set() or
                                  (step is not None and self.step != step), timeout_s)
        return self.status(load=False)

    def _run(self, command: list[str], env: dict[str, str], started: list[Any],
             ready: threading.Event) -> None:
        """Start the server and wait for it, in one thread that lives as long as the server:
        the server's parent-death signal is tied to the thread that started it (Ray may end
        the threads that run an actor's calls)."""
        try:
            with open(self.log_path, "ab") as log:       # a restart appends: this run's part
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True, preexec_fn=_die_with_parent)
                started.extend((proc, log.tell()))
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
        # not asked before it was ready once: while it starts, its log says where it is
        health = http_json(f"{self.url}/health")[0] if self.ready.is_set() else 0
        _, metrics = http_json(f"{self.url}/metrics") if health == 200 and load else (0, "")
        return {"name": self.name, "role": self.role, "node": self.node, "ip": self.ip,
                "url": self.url, "pid": self.proc.pid, "started": self.started,
                "ready": health == 200, "draining": self.draining,
                "step": self.step if health != 200 else READY_STEP,
                "running": metric(metrics, "vllm:num_requests_running"),
                "waiting": metric(metrics, "vllm:num_requests_waiting"),
                "kv_blocks": metric(metrics, "kvrelay:kv_blocks_used"),
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
    return [n for n in actor_names(ray, ns) if n != PROXY]


def server_handle(name: str, ns: str) -> Any:
    import ray
    return ray.get_actor(name, namespace=ns)


def actor_names(ray: Any, ns: str) -> list[str]:
    """Every actor of the deployment (its servers and its proxy)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == ns)

