"""Backends, how the proxy picks them, and how it rewrites request bodies.

Pure bookkeeping (no I/O), so the rules are unit-tested with exact values:

- `expand_endpoints`: the `--prefiller-host/--prefiller-port` (and decoder) pairing rules.
- `Backend`: one server, its HTTP client, and what the proxy knows of its state (server
  choice itself is in `policy.py`).
- `prefill_body` / `decode_body`: the vLLM-compatible KV-transfer wire format.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

# What the proxy asks a prefill server for: compute the prompt's KV, keep it for a remote decode.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Sampling fields a one-token prefill must not see (vLLM's proxy drops them too).
PREFILL_DROPPED_FIELDS = ("stream_options", "min_tokens", "min_completion_tokens")
# Addresses a prefill may advertise that a decode server cannot dial.
UNROUTABLE_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
# After a connection failure a backend is tried last for this long (the others first).
COOLDOWN_S = 5.0
# A /metrics scrape older than this no longer counts towards a server's load.
REPORT_STALE_S = 10.0


class EndpointError(ValueError):
    """A host/port flag combination that does not describe a set of servers."""


@dataclass(eq=False)
class Backend:
    """One prefill or decode server, with its shared HTTP client and live counters.

    Its place in a changing set (`--backends-file`) is `ProxyState`'s to change: `ready`
    (it answered a first healthy /health since it was added: flag-given servers start
    ready), `draining` (removed: no new requests, those in flight finish), `dropped`
    (drained and forgotten: nothing may use it any more), `holds` (requests it prefilled
    whose decode leg has not ended: the decode pulls the KV it holds, and a free notice may
    still go to it)."""

    role: str                      # "prefill" | "decode"
    host: str
    port: int
    client: httpx.AsyncClient | None = None
    id: str = ""                   # the backends file's stable name ("" → `name`)
    ready: bool = True
    draining: bool = False
    dropped: bool = False
    holds: int = 0
    in_flight: int = 0
    failures: int = 0
    down_until: float = 0.0        # monotonic time until which it is tried last
    healthy: bool = True           # the last background /health probe answered 200
    # What the server's /metrics last said (vLLM's names), polled with the /health probe.
    running: float = 0.0           # vllm:num_requests_running
    waiting: float = 0.0           # vllm:num_requests_waiting
    kv_usage: float = 0.0          # vllm:kv_cache_usage_perc (0..1)
    prefix_queries: float = 0.0    # vllm:prefix_cache_queries_total (tokens)
    prefix_hits: float = 0.0       # vllm:prefix_cache_hits_total (tokens)
    reported_at: float = 0.0       # monotonic time of that scrape; 0: never
    # Prefix-cache tokens the router expected this server to hit (cache_hit routes), and
    # the (expected, reported hits) at the start of the current check window.
    expected_hits: float = 0.0
    window_start: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        self.id = self.id or self.name

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def takes_requests(self) -> bool:
        """New requests may go to it: admitted, and neither draining nor dropped."""
        return self.ready and not self.draining

    @property
    def state(self) -> str:
        """active | unready | draining (`kvrelay_proxy:backends`)."""
        if self.draining:
            return "draining"
        return "active" if self.ready else "unready"

    @property
    def idle(self) -> bool:
        """Nothing in flight on it, and no request still needs it."""
        return self.in_flight == 0 and self.holds == 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def cooling(self, now: float | None = None) -> bool:
        """Tried last: its /health probe failed, or a connection to it failed lately."""
        return not self.healthy or (time.monotonic() if now is None else now) < self.down_until

    def reported_load(self, now: float | None = None) -> float:
        """Running + waiting requests per the last scrape, if it is recent (else 0)."""
        now = time.monotonic() if now is None else now
        if not self.reported_at or now - self.reported_at > REPORT_STALE_S:
            return 0.0
        return self.running + self.waiting

    def mark_failed(self) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + COOLDOWN_S

    def mark_ok(self) -> None:
        self.down_until = 0.0


def expand_endpoints(hosts: list[str], ports: list[int], flag: str) -> list[tuple[str, int]]:
    """Pair `--{flag}-host` values with `--{flag}-port` values.

    one host + N ports → N servers on that host; N hosts + N ports → pairs;
    N hosts + 1 port → each host on that port. Anything else is an `EndpointError`.
    """
    if not hosts or not ports:
        raise EndpointError(f"--{flag}-host and --{flag}-port each need at least one value")
    if len(hosts) == len(ports):
        pairs = list(zip(hosts, ports))
    elif len(hosts) == 1:
        pairs = [(hosts[0], p) for p in ports]
    elif len(ports) == 1:
        pairs = [(h, ports[0]) for h in hosts]
    else:
        raise EndpointError(
            f"--{flag}-host has {len(hosts)} values and --{flag}-port has {len(ports)}: "
            f"give one host, one port, or as many hosts as ports")
    for host, port in pairs:
        if not host:
            raise EndpointError(f"--{flag}-host: empty host name")
        if not 1 <= port <= 65535:
            raise EndpointError(f"--{flag}-port: {port} is not a TCP port (1-65535)")
    dupes = sorted({f"{h}:{p}" for h, p in pairs if pairs.count((h, p)) > 1})
    if dupes:
        raise EndpointError(f"--{flag}-host/--{flag}-port: {', '.join(dupes)} listed twice")
    return pairs


def prefill_edit(body: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """How the prefill server's body differs from the client's: the fields set (one token,
    not streamed, KV kept) and the fields left out."""
    changes: dict[str, Any] = {"max_tokens": 1, "stream": False,
                               "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS)}
    if "max_completion_tokens" in body:
        changes["max_completion_tokens"] = 1
    return changes, PREFILL_DROPPED_FIELDS


def edited(body: Mapping[str, Any], changes: Mapping[str, Any],
           drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """`body` with an edit applied (what `ClientBody.payload` sends, as a dict)."""
    out = {k: v for k, v in body.items() if k not in drop}
    out.update(changes)
    return out


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body as the prefill server gets it (`prefill_edit` applied)."""
    return edited(body, *prefill_edit(body))


def routable_kv_params(kv_params: dict[str, Any], prefill_host: str) -> dict[str, Any]:
    """The prefill's `kv_transfer_params` with a wildcard/empty `remote_host` replaced by
    the prefill host the proxy reached (so decode can dial it)."""
    out = dict(kv_params)
    host = out.get("remote_host")
    if host is None or (isinstance(host, str) and host.strip() in UNROUTABLE_HOSTS):
        out["remote_host"] = prefill_host
    return out


def decode_body(body: Mapping[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The client's original body with the prefill's `kv_transfer_params`."""
    return edited(body, {"kv_transfer_params": kv_params})


def free_notice(kv_params: dict[str, Any]) -> dict[str, Any] | None:
    """Body of `POST /v1/kv_transfer/free` to the prefill, or None when there is no id."""
    if not kv_params.get("remote_request_id"):
        return None
    return {"remote_request_id": kv_params["remote_request_id"],
            "remote_engine_id": kv_params.get("remote_engine_id")}
