"""The HTTP side's serve flags as typed values, checked when made: `HTTPOptions` (where the
server listens, its API key, the admission bounds, the trusted proxies) and `--tool-server`'s
entries (`ToolServer`, `parse_tool_servers`).

`kvrelay serve` makes them before torch, the app or a port (kvrelay/cli.py), so this
module imports nothing of the server but the admission bounds. `--tool-server` (vLLM's
flag) lists the MCP servers this server may connect to, comma-separated; each entry is
`[LABEL=]ADDRESS`, ADDRESS either `host:port` (its streamable HTTP endpoint
`http://host:port/mcp`) or a URL (`http://host:port/path`):

    --tool-server calc=127.0.0.1:8001,http://10.0.0.5:9000/mcp

What a request may do with them is `server/mcp/servers.py`'s.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvrelay.server.admission import (
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    AdmissionLimits,
)

DEFAULT_PATH = "/mcp"          # the streamable HTTP endpoint of an entry given as host:port
LABEL = re.compile(r"^[A-Za-z0-9_-]{1,64}$")     # a --tool-server label, a request's too


@dataclass(frozen=True)
class HTTPOptions:
    """The serve flags of the HTTP side (not the engine's)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None                 # None: /v1/* needs no key
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    forwarded_allow_ips: str | None = None     # None: X-Forwarded-For / -Proto not trusted

    def __post_init__(self) -> None:
        self.limits(running=1)                 # the bounds' own checks (ValueError names the flag)

    def limits(self, running: int) -> AdmissionLimits:
        """The admission bounds of a server whose engine runs `running` sequences at once."""
        return AdmissionLimits(running, self.max_queued_requests, self.max_seqs_per_request)


@dataclass(frozen=True)
class ToolServer:
    """One `--tool-server` entry: its label (may be None) and normalised URL."""
    label: str | None
    url: str


def normalise_url(text: str) -> str:
    """`http(s)://host[:port][/path]` in one spelling (lower-case scheme and host, the
    default port dropped, an empty path → /mcp, no trailing slash); ValueError otherwise."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http(s)://host:port[/path] or host:port, got {text!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"a tool server URL has no user, query or fragment: {text!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"                   # IPv6
    default = 443 if parts.scheme == "https" else 80
    netloc = host if port in (None, default) else f"{host}:{port}"
    path = parts.path.rstrip("/") or DEFAULT_PATH
    return f"{parts.scheme}://{netloc}{path}"


def parse_tool_servers(text: str | None) -> tuple[ToolServer, ...]:
    """`--tool-server`'s value → its entries (ValueError naming the flag and the entry)."""
    if not text:
        return ()
    out: list[ToolServer] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry == "demo":
            raise ValueError("--tool-server demo: kvrelay has no demo tools; list MCP servers "
                             "as [LABEL=]host:port or [LABEL=]http://host:port/path")
        label, address = entry.split("=", 1) if "=" in entry.split("://")[0] else ("", entry)
        if label and not LABEL.match(label):
            raise ValueError(f"--tool-server {entry!r}: a label is 1-64 letters, digits, '_' "
                             f"or '-'")
        if "://" not in address:
            address = f"http://{address}"
        try:
            url = normalise_url(address)
        except ValueError as e:
            raise ValueError(f"--tool-server {entry!r}: {e}") from None
        out.append(ToolServer(label or None, url))
    labels = [s.label for s in out if s.label]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"--tool-server: label(s) {dupes} given twice")
    return tuple(out)
