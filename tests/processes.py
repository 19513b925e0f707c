"""Start real kvrelay processes on 127.0.0.1 for tests, and always stop them."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_handed_out: set[int] = set()
_rng = random.Random()                 # its own: a test that seeds `random` must not repeat ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on, for a server the test starts later.

    Between this call and the server's bind the port is free, so the kernel's own picks must
    not land on it: it comes from below the ephemeral range (where `bind(0)`, client
    connections and `refused_port` take theirs), and no port is handed out twice in a run.
    """
    low = _ephemeral_low()
    first = 20000 if low > 21000 else 1025
    for _ in range(1000):
        port = _rng.randrange(first, low) if low > first else _kernel_pick()
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {first}-{low - 1}")


def _kernel_pick() -> int:
    """Where the ephemeral range leaves no room below it: the kernel's own pick."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KvrelayProcess:
    """`kvrelay <args>` in its own process group; `stop()` ends the group."""

    _terminated = False             # (a class default: subclasses may start their own Popen)

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 -- closed by stop()
        full_env = os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_line(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError("process exited with "
                                   f"{self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"no {text!r} within {timeout}s:\n{self.log()[-3000:]}")

    def terminate(self) -> None:
        """SIGTERM to the group, without waiting: `stop_all` overlaps several shutdowns."""
        if self.proc.poll() is None and not self._terminated:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc.poll() is None:
            self.terminate()          # once: a second SIGTERM would cut uvicorn's drain short
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # stragglers (engine core) of the group
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode


def stop_all(processes: list[KvrelayProcess]) -> None:
    """Stop several processes at once: every group gets its SIGTERM first, then each is
    waited for, so their graceful shutdowns (about a second each) overlap."""
    for p in processes:
        p.terminate()
    for p in processes:
        p.stop()


class Server(KvrelayProcess):
    def __init__(self, model: str | None, extra: list[str], log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["serve"] + ([model] if model else []) + ["--port", str(self.port)] + extra
        super().__init__(args, log, env)

    def wait_ready(self, timeout: float = 180) -> None:
        self.wait_for_line("Application startup complete", timeout)
        assert httpx.get(f"{self.url}/health").status_code == 200

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values.setdefault(sample.name, sample.value)
        return values


def descendants(pid: int) -> list[int]:
    """All live descendant pids of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
