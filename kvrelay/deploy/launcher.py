"""Start the planned processes on this machine, await readiness, supervise, stop them all.

Every process is `python -m kvrelay.cli <args>` in a session (process group) of its own,
its output in `<log dir>/<name>.log` (a restart appends to it). Every server gets the
topology's KV secret as `KVRELAY_KV_SECRET` in its environment (never on a command line or
in a log). Once the topology is up, a process that exits is restarted after a backoff
(1 s, doubling to 30 s; back to 1 s once it has run `STABLE_S`) — the proxy routes around a
server meanwhile — or, with `restart=False`, reported so that everything stops. Stopping
sends SIGTERM to each group (the proxy first; servers drain in-flight requests), then SIGKILL
to whatever is left of each group after the grace period. Nothing is found by name: only
the PIDs started here are signalled.

While the processes come up, each one's step (`log_steps.STEPS`: starting, building the model,
loading the weights, warming up, ready …) is read from its log: a line when a process moves
to another step, and every STATUS_EVERY_S a line with where each one is.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay import envs
from kvrelay.deploy.layout import KV_SECRET_ENV, Plan, ProxyPlan
from kvrelay.deploy.log_steps import LogSteps

logger = logging.getLogger(__name__)
STOP_GRACE_S = 35.0          # kvrelay serve drains in-flight requests for up to 30 s
TAIL_LINES = 25
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0              # a process up this long has its backoff reset
STATUS_EVERY_S = 15.0        # bring-up: a line with every process's step this often


class DeployFailure(RuntimeError):
    """A component exited or was not ready in time; the message names it and shows its log tail."""


@dataclass(eq=False)
class Component:
    """One started process (a process-group leader) and its log file."""

    name: str
    args: tuple[str, ...]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    is_ready: bool = False
    log_offset: int = 0            # where this run's output starts in the log (restarts append)
    started_at: float = 0.0
    restarts: int = 0
    steps: LogSteps = field(init=False)   # what this run's log says it is doing

    def __post_init__(self) -> None:
        self.steps = LogSteps(self.log_path)

    def start(self) -> None:
        mode = "ab" if self.proc is not None else "wb"
        with open(self.log_path, mode) as log:      # the child keeps its own copy of the descriptor
            self.log_offset = log.tell()
            self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        self.is_ready = False
        self.started_at = time.monotonic()
        self.steps = LogSteps(self.log_path, self.log_offset)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def step(self) -> str:
        return self.steps.step

    def check_ready(self) -> bool:
        if not self.is_ready:
            self.steps.update()
            self.is_ready = self.steps.ready
        return self.is_ready

    def update_step(self) -> bool:
        """Read the log written since the last call; True when the step changed."""
        return self.steps.update()

    def log_text(self, offset: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = TAIL_LINES) -> str:
        return "\n".join("    " + line for line in self.log_text().splitlines()[-lines:])

    def signal_leader(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> bool:
        """Signal this component's process group; False when it no longer exists."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


def status_line(components: list[Component], waited: float) -> str:
    """`waiting 30s: decode-0 warming up, prefill-0 loading the weights, prefill-1 ready`."""
    return (f"waiting {waited:.0f}s: "
            + ", ".join(f"{c.name} {'exited' if c.poll() is not None else c.step}"
                        for c in components))


def child_env(exports: tuple[tuple[str, str], ...],
              own: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """This process's environment plus the plan's variables. A KVRELAY_ twin of a variable the
    plan sets by its tutorial name is dropped, since the KVRELAY_ name would win."""
    env = dict(os.environ)
    twins = {v.alias: v.name for v in envs.ALL if v.alias}
    for name, value in exports + own:
        env.pop(twins.get(name, ""), None)
        env[name] = value
    env["PYTHONUNBUFFERED"] = "1"
    return env


def ports_in_use(plan: Plan) -> list[str]:
    """The planned ports something on this machine already listens on."""
    claims = [(s.port, f"{s.name} HTTP") for s in plan.servers]
    claims += [(p, f"{s.name} side channel") for s in plan.servers for p in s.side_channel_ports]
    if plan.proxy:
        claims.append((plan.proxy.port, "proxy HTTP"))
    busy = []
    for port, what in claims:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                busy.append(f"{what} port {port} is already in use on this machine")
    return busy


class Deployment:
    """Owner of every process deploy started on this machine (by PID; each its own group)."""

    def __init__(self, plan: Plan, log_dir: Path, kv_secret: str = "") -> None:
        if not plan.topology.local:
            raise ValueError("deploy starts processes on this machine only; for other hosts use "
                             "--dry-run and run the printed commands there")
        self.plan = plan
        self.log_dir = log_dir
        self.kv_secret = kv_secret               # handed to every server, printed nowhere
        self.components: list[Component] = []
        self.force = threading.Event()           # a second Ctrl-C: SIGKILL at once

    # -- starting ------------------------------------------------------------------------
    def start_servers(self) -> list[Component]:
        """Every server at once (decode first: it has no dependency on prefill at startup)."""
        order = sorted(self.plan.servers, key=lambda s: s.role != "decode")
        secret = ((KV_SECRET_ENV, self.kv_secret),) if self.kv_secret else ()
        return [self._start(s.name, s.args, child_env(self.plan.exports, s.env + secret))
                for s in order]

    def start_proxy(self) -> Component:
        proxy = self.plan.proxy
        assert isinstance(proxy, ProxyPlan)
        return self._start("proxy", proxy.args, child_env((), ()))

    def _start(self, name: str, args: tuple[str, ...], env: dict[str, str]) -> Component:
        c = Component(name, args, env, self.log_dir / f"{name}.log")
        c.start()
        self.components.append(c)
        logger.info("started %s (pid %d), log %s", name, c.pid, c.log_path)
        return c

    def await_ready(self, components: list[Component], timeout: float,
                    stop: threading.Event, say: Callable[[str], None] | None = None) -> bool:
        """True once each logged "Application startup complete"; False if `stop` was set.
        Raises DeployFailure when one exits first or the timeout passes. `say` hears each
        step a component reaches and, every STATUS_EVERY_S, where each one is."""
        t0 = time.monotonic()
        deadline, next_status = t0 + timeout, t0 + STATUS_EVERY_S
        while True:
            if stop.is_set():
                return False
            pending = []
            for c in components:
                before = c.step
                if not c.check_ready():
                    pending.append(c)
                if say is not None and c.step != before:
                    say(f"{c.name}: {c.step} ({time.monotonic() - c.started_at:.1f}s)")
            if not pending:
                return True
            if say is not None and time.monotonic() >= next_status:
                say(status_line(components, time.monotonic() - t0))
                next_status += STATUS_EVERY_S
            for c in pending:
                rc = c.poll()
                if rc is not None:
                    raise DeployFailure(f"{c.name} exited with status {rc} before it was ready; "
                                        f"last lines of {c.log_path}:\n{c.tail()}")
            if time.monotonic() > deadline:
                c = pending[0]
                raise DeployFailure(
                    f"{', '.join(p.name for p in pending)} not ready within {timeout:.0f}s (raise "
                    f"--engine-ready-timeout or {envs.ENGINE_READY_TIMEOUT_S.shown}); last lines "
                    f"of {c.log_path}:\n{c.tail()}")
            time.sleep(0.25)

    def watch(self, stop: threading.Event) -> Component | None:
        """Wait until `stop` is set (None) or a component exits (that component)."""
        while not stop.wait(0.5):
            for c in self.components:
                if c.poll() is not None:
                    return c
        return None

    def supervise(self, stop: threading.Event, say: Callable[[str], None]) -> None:
        """Until `stop` is set: restart each component that exits, after its backoff, and say
        when it is ready again."""
        due: dict[Component, float] = {}              # exited, restart at this monotonic time
        while not stop.wait(0.25):
            now = time.monotonic()
            for c in self.components:
                if c in due:
                    if now >= due[c]:
                        del due[c]
                        self._restart(c, say)
                elif c.poll() is not None:
                    due[c] = now + self._backoff(c, now)
                    say(f"{c.name} (pid {c.pid}) exited with status {c.poll()}; restarting it "
                        f"in {due[c] - now:.0f}s (restart {c.restarts + 1}; --no-restart stops "
                        f"everything instead). Last lines of {c.log_path}:\n{c.tail(10)}")
                elif c.restarts and not c.is_ready and c.check_ready():
                    say(f"{c.name} is ready again (pid {c.pid}, restart {c.restarts})")

    def _backoff(self, c: Component, now: float) -> float:
        if c.is_ready and now - c.started_at >= STABLE_S:
            c.restarts = 0                            # it ran well: start the backoff over
        return RESTART_BACKOFF_S[min(c.restarts, len(RESTART_BACKOFF_S) - 1)]

    def _restart(self, c: Component, say: Callable[[str], None]) -> None:
        c.signal_group(signal.SIGKILL)                # what is left of its group (an engine core)
        c.restarts += 1
        c.start()
        logger.info("restarted %s (pid %d)", c.name, c.pid)
        say(f"restarted {c.name} (pid {c.pid})")

    # -- stopping ------------------------------------------------------------------------
    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM every leader (proxy first), wait up to `grace`, then SIGKILL what is left of
        each group. Only the leader: a server drains its requests, then stops its own engine
        (a SIGTERM to the whole group would kill the engine under the draining requests)."""
        for c in reversed(self.components):
            if c.poll() is None:
                c.signal_leader(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in reversed(self.components):
            while c.poll() is None and time.monotonic() < deadline and not self.force.is_set():
                time.sleep(0.1)
            if c.poll() is None:
                logger.warning("%s (pid %d) did not stop within %.0fs: killing it", c.name, c.pid,
                               grace)
        for c in self.components:
            c.signal_group(signal.SIGKILL)  # the leader if still there, and stragglers of its group
            if c.proc is not None:
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    logger.error("%s (pid %d) survived SIGKILL", c.name, c.pid)
