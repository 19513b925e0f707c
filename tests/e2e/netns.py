"""Two "hosts" on one machine: network namespaces joined by a veth pair (for DI tests).

    namespace kvp<pid>                          namespace kvd<pid>
    lo, veth kvp<pid>  10.<a>.<b>.1/24 ◀──────▶ veth kvd<pid> 10.<a>.<b>.2/24, lo

No default route in either: a listener on 0.0.0.0 must advertise its veth address.
Processes run with `ip netns exec`; the test process itself stays in the root
namespace, so HTTP calls go through a small client run inside a namespace.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.processes import KvrelayProcess

CLIENT = Path(__file__).with_name("netns_client.py")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


@dataclass
class Host:
    netns: str
    device: str
    address: str


class VethPair:
    """Create with `up()`, remove with `down()` (idempotent, also after a failed `up`)."""

    def __init__(self) -> None:
        pid = os.getpid()
        net = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.prefill = Host(f"kvp{pid}", f"kvp{pid}", f"{net}.1")
        self.decode = Host(f"kvd{pid}", f"kvd{pid}", f"{net}.2")

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be used here (None if they can): tries to make one."""
        probe = f"kvprobe{os.getpid()}"
        try:
            r = _ip("netns", "add", probe, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`ip netns` unavailable: {e}"
        if r.returncode != 0:
            return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def up(self) -> None:
        p, d = self.prefill, self.decode
        _ip("netns", "add", p.netns)
        _ip("netns", "add", d.netns)
        _ip("link", "add", p.device, "type", "veth", "peer", "name", d.device)
        for h in (p, d):
            _ip("link", "set", h.device, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.device)
            _ip("-n", h.netns, "link", "set", h.device, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    def down(self) -> None:
        for h in (self.prefill, self.decode):
            _ip("netns", "del", h.netns, check=False)        # takes its end of the veth with it
        _ip("link", "del", self.prefill.device, check=False)  # if it never left the root namespace


class NetnsProcess(KvrelayProcess):
    """`kvrelay <args>` inside a network namespace (its own process group, as the base)."""

    def __init__(self, netns: str, args: list[str], log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed by stop())
        full_env = os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {})
        self.proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-m",
                                      "kvrelay.cli", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)


def http(netns: str, calls: list[dict]) -> list[dict]:
    """Run HTTP calls from inside `netns`: each {"method", "url", "json"?} → {"status", "body"}."""
    r = subprocess.run(["ip", "netns", "exec", netns, sys.executable, str(CLIENT)],
                       input=json.dumps(calls),
                       capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"client in {netns} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)
