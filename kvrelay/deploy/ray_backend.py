"""`kvrelay deploy --backend ray`: the topology's servers and its proxy as detached, named Ray
actors on a running cluster, supervised and scaled by Ray (the actors: ray_actors.py).

    kvrelay deploy --backend ray --prefill 2 --decode 1 [--name NAME] [-- serve flags]
    kvrelay deploy status [--name NAME]          each server's node, URL, health and load
    kvrelay deploy scale --prefill 3 [--name NAME] [same topology flags as the deploy]
    kvrelay deploy --down [--name NAME]

`deploy` places a `ServerActor` per server (spread over the nodes, restarted by Ray), then the
proxy's actor once a server has loaded its weights, and waits on one `wait_ready` call per
server (answered at each step the server's log shows).

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
import logging
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvrelay import envs
from kvrelay.deploy.layout import KV_SECRET_ENV, Plan, ServerPlan
from kvrelay.deploy.log_steps import STARTING, step_reached
from kvrelay.deploy.ray_actors import (
    NOT_SHIPPED,
    PROXY,
    STOP_GRACE_S,
    WAIT_S,
    ProxyActor,
    ServerActor,
    actor_names,
    http_json,
    metric,
    server_names,
)

logger = logging.getLogger(__name__)

PROG = "kvrelay deploy"
NAMESPACE_PREFIX = "kvrelay-deploy-"
MAX_RESTARTS = 20
IDLE_S = 1.0                 # a drained server idle this long is stopped


def namespace(name: str) -> str:
    return NAMESPACE_PREFIX + name


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


PROXY_AFTER = "allocating the KV cache"    # the proxy is placed once a server is this far


def _server_env(plan: Plan, server: ServerPlan, secret: str) -> dict[str, str]:
    env = dict(plan.exports) | dict(server.env) | {KV_SECRET_ENV: secret}
    return {k: v for k, v in env.items() if k not in NOT_SHIPPED}


def _place(ray: Any, cls: type, name: str, ns: str, cpus: int, *args: Any) -> Any:
    """A detached named actor (it outlives `deploy`), spread over the nodes, restarted by
    Ray when it dies; a few concurrent calls (status while it stops or while `deploy` and the
    proxy's follower wait on `wait_ready`)."""
    return _remote_class(ray, cls).options(
        name=name, namespace=ns, lifetime="detached", max_restarts=MAX_RESTARTS,
        max_task_retries=0, num_cpus=cpus, max_concurrency=8,
        scheduling_strategy="SPREAD").remote(*args)


_REMOTE: dict[type, Any] = {}


def _remote_class(ray: Any, cls: type) -> Any:
    """`ray.remote(cls)` once per class: each wrapping is another class for Ray to export
    (~0.1 s a server on two busy cores)."""
    if cls not in _REMOTE:
        _REMOTE[cls] = ray.remote(cls)
    return _REMOTE[cls]


def start_servers(ray: Any, plan: Plan, servers: list[ServerPlan], ns: str, secret: str,
                  log_dir: str) -> list[Any]:
    from kvrelay.distributed.ray_cluster import cpus_per_worker
    out = []
    for s in servers:
        cpus = len(s.devices) * cpus_per_worker()
        out.append(_place(ray, ServerActor, s.name, ns, cpus, s.name, s.role, s.args, s.port,
                          _server_env(plan, s, secret), log_dir, cpus))
    return out


def await_ready(ray: Any, handles: list[Any], timeout_s: float, say: Callable[[str], None],
                then: tuple[str, Callable[[], Any]] | None = None) -> list[dict[str, Any]]:
    """Every handle's status once all are ready (in order); TimeoutError naming those that
    are not. One `wait_ready` call per server at a time, answered when the server moves to
    another step (said as the local deploy says it), when it is ready, or after WAIT_S
    (then a line says where each one is, and it asks again). `then` = (step, place): once
    the first server reaches that step (log_steps.STEPS), `place()` gives one more actor
    (the proxy) to wait for, whose status comes last."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    handles = list(handles)
    states: dict[int, dict[str, Any]] = {}
    last: dict[int, dict[str, Any]] = {}
    pending = {h.wait_ready.remote(WAIT_S, STARTING): i for i, h in enumerate(handles)}
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
            if st is not None:
                if st.get("step") and st.get("step") != last.get(i, {}).get("step"):
                    say(f"{st['name']}: {st['step']} ({time.time() - st['started']:.1f}s)")
                last[i] = st
                if then is not None and step_reached(st.get("step"), then[0]):
                    handles.append(then[1]())
                    pending[handles[-1].wait_ready.remote(WAIT_S, STARTING)] = len(handles) - 1
                    then = None
                if st["ready"]:
                    states[i] = st
                    continue
            step = last[i].get("step", STARTING) if i in last else STARTING
            pending[handles[i].wait_ready.remote(WAIT_S, step)] = i
        if pending and time.monotonic() - said >= WAIT_S:
            say(f"waiting {time.monotonic() - t0:.0f}s: " + ", ".join(
                f"{st['name']} {st.get('step') or 'starting'}" for st in last.values()))
            said = time.monotonic()
    if then is not None:                        # no server reported that step (all ready)
        handles.append(then[1]())
        states[len(handles) - 1] = await_ready(ray, handles[-1:], timeout_s, say)[0]
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
    existing = actor_names(ray, ns)
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
        # the proxy once a server has loaded its weights: its actor's worker (a Python
        # process importing Ray) and the proxy's own start then take no CPU from the
        # servers' imports and loads, and are done by the time the last server is ready —
        # it lists each server in its backends file as soon as that one is ready
        proxy_env, port = {KV_SECRET_ENV: secret} | dict(plan.exports), plan.proxy.port
        *states, proxy_state = await_ready(
            ray, handles, timeout + 15, say, then=(PROXY_AFTER, lambda: _place(
                ray, ProxyActor, PROXY, ns, 1, proxy_command(plan), port, proxy_env, log_dir,
                ns, settings)))
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
        code, text = http_json(f"{proxy_url}/metrics")
        got = {role: metric(text, f'kvrelay_proxy:backends{{role="{role}",state="active"}}')
               for role in ("prefill", "decode")}
        if code == 200 and got["prefill"] >= prefill and got["decode"] >= decode:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the proxy has {got} active backends after {timeout_s:.0f}s, "
                               f"expected {prefill} prefill and {decode} decode")
        time.sleep(0.1)                 # an HTTP GET: the servers are up by now



def _deployment(name: str, address: str | None,
                say: Callable[[str], None]) -> tuple[Any, str, list[str]]:
    """(ray, namespace, actor names) of deployment `name`; no names: it says so."""
    ray = _connect(address)
    ns = namespace(name)
    names = actor_names(ray, ns)
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
        _, text = http_json(f"{proxy_url}/metrics")
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
