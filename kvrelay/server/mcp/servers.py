"""Which MCP servers a request may use: a request's entries against the operator's allowlist.

`--tool-server` (vLLM's flag) lists the MCP servers this server may connect to; its entries
(`ToolServer`) are parsed with the other serve flags, in `server/options.py`.

A request's `{"type": "mcp", "server_label": L, "server_url": U, ...}` names one of them —
by its URL (compared after normalising scheme, host, port and path), or, without a URL, by
the entry's LABEL. Anything else is a 400: the server never connects to a URL a client
made up (server-side request forgery). `require_approval` is OpenAI's: "always" (the
default), "never", or `{"always": FILTER, "never": FILTER}` (FILTER: `{"tool_names": [...],
"read_only": bool}`); `connector_id` / `tunnel_id` (OpenAI's hosted connectors) are refused.

gpt-oss's built-in tools are served by the entries labelled `browser` and `python`
(`--tool-server browser=127.0.0.1:8001,python=127.0.0.1:8002`): a request's
`{"type": "web_search_preview"}` (or `web_search`) uses the first, `{"type":
"code_interpreter"}` the second (`resolve_builtin`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.options import LABEL, ToolServer, normalise_url
from kvrelay.server.options import parse_tool_servers as parse_tool_servers  # re-exported
from kvrelay.server.protocol import OpenAIError


@dataclass(frozen=True)
class ToolFilter:
    """OpenAI's tool filter (`allowed_tools`, `require_approval.always` / `.never`): the tools
    named (None: all) and, with `read_only`, only those annotated `readOnlyHint`."""
    tool_names: frozenset[str] | None = None
    read_only: bool = False

    def matches(self, name: str, annotations: Mapping[str, Any] | None) -> bool:
        if self.tool_names is not None and name not in self.tool_names:
            return False
        return not self.read_only or bool((annotations or {}).get("readOnlyHint"))


ASK_ALL = (ToolFilter(), None)                 # require_approval "always" (OpenAI's default)
ASK_NONE = (None, ToolFilter())                # require_approval "never"


@dataclass(frozen=True)
class McpServerRef:
    """One `{"type": "mcp"}` entry of a request, resolved to an allowed server."""
    label: str                                 # the request's server_label
    url: str                                   # the allowlisted URL it resolved to
    raw: Mapping[str, Any]                     # the entry as sent (echoed without secrets)
    headers: dict[str, str] = field(default_factory=dict)
    tool_names: frozenset[str] | None = None   # allowed_tools (None: all)
    read_only: bool = False                    # allowed_tools.read_only: readOnlyHint tools
    # require_approval: (always, never) filters; a tool neither matches is asked about
    approval: tuple[ToolFilter | None, ToolFilter | None] = ASK_NONE

    def allows(self, name: str, annotations: Mapping[str, Any] | None) -> bool:
        return ToolFilter(self.tool_names, self.read_only).matches(name, annotations)

    def asks(self, name: str, annotations: Mapping[str, Any] | None) -> bool:
        """Whether a call of `name` waits for the client's approval (an
        `mcp_approval_request` item) instead of being made."""
        always, never = self.approval
        if always is not None and always.matches(name, annotations):
            return True
        return never is None or not never.matches(name, annotations)

    def as_response_tool(self) -> dict[str, Any]:
        """The entry as a response echoes it: its headers and token are not repeated."""
        out = {k: v for k, v in self.raw.items() if k not in ("headers", "authorization")}
        return {**out, "headers": None, "server_url": out.get("server_url", self.url)}


def is_mcp(tool: Any) -> bool:
    return isinstance(tool, Mapping) and tool.get("type") == "mcp"


def resolve(raw: Mapping[str, Any], where: str, allowed: tuple[ToolServer, ...]) -> McpServerRef:
    """A request's `{"type": "mcp"}` entry → the server it may use; 400 otherwise."""
    label = raw.get("server_label")
    if not isinstance(label, str) or not LABEL.match(label):
        raise OpenAIError(f"{where}.server_label: expected 1-64 letters, digits, '_' or '-', "
                          f"got {label!r}", param=where)
    for unsupported in ("connector_id", "tunnel_id"):
        if raw.get(unsupported) is not None:
            raise OpenAIError(f"{where}.{unsupported}: OpenAI's hosted connectors are not "
                              f"available here; name a server of --tool-server", param=where)
    approval = _approval(raw.get("require_approval", "always"), where)
    if not allowed:
        raise OpenAIError(f"{where}: this server connects to no MCP servers (its operator "
                          f"lists them with --tool-server)", param=where)
    url = _allowed_url(raw, label, where, allowed)
    names, read_only = _allowed_tools(raw, where)
    return McpServerRef(label, url, raw, _headers(raw, where), names, read_only, approval)


# a request's built-in tool types → the harmony namespace and the --tool-server label
BUILTIN_TYPES = {"web_search_preview": "browser", "web_search": "browser",
                 "code_interpreter": "python"}


def builtin_namespace(tool: Any) -> str | None:
    """`browser` / `python` for a request's built-in tool entry, else None."""
    return BUILTIN_TYPES.get(str(tool.get("type"))) if isinstance(tool, Mapping) else None


def resolve_builtin(raw: Mapping[str, Any], where: str,
                    allowed: tuple[ToolServer, ...]) -> McpServerRef:
    """A request's `{"type": "web_search_preview"}` / `{"type": "code_interpreter"}` → the
    `--tool-server` entry labelled `browser` / `python`; 400 when there is none (kvrelay
    ships no search engine or sandbox of its own)."""
    namespace = BUILTIN_TYPES[str(raw["type"])]
    for server in allowed:
        if server.label == namespace:
            return McpServerRef(namespace, server.url, raw)
    raise OpenAIError(f"{where}: {raw['type']!r} runs gpt-oss's built-in {namespace} tool on "
                      f"the MCP server of the --tool-server entry labelled {namespace!r}, and "
                      f"this server has none", param=where)


def _allowed_url(raw: Mapping[str, Any], label: str, where: str,
                 allowed: tuple[ToolServer, ...]) -> str:
    given = raw.get("server_url")
    if given is None:
        for server in allowed:
            if server.label == label:
                return server.url
        raise OpenAIError(f"{where}: no server_url, and no --tool-server entry is labelled "
                          f"{label!r} (labels: {sorted(s.label for s in allowed if s.label)})",
                          param=where)
    try:
        url = normalise_url(given) if isinstance(given, str) else ""
    except ValueError:
        url = ""
    if url and any(s.url == url for s in allowed):
        return url
    raise OpenAIError(f"{where}.server_url: {given!r} is not one of the MCP servers this server "
                      f"may connect to (--tool-server); kvrelay connects only to the servers its "
                      f"operator listed", param=f"{where}.server_url")


def _approval(value: Any, where: str) -> tuple[ToolFilter | None, ToolFilter | None]:
    """`require_approval` → its (always, never) filters: "always", "never", or
    `{"always": FILTER, "never": FILTER}` (either may be left out)."""
    if value == "always":
        return ASK_ALL
    if value == "never":
        return ASK_NONE
    if isinstance(value, Mapping) and set(value) <= {"always", "never"}:
        out = []
        for key in ("always", "never"):
            f = value.get(key)
            out.append(None if f is None else _filter(f, f"{where}.require_approval.{key}"))
        return out[0], out[1]
    raise OpenAIError(f"{where}.require_approval: expected 'always', 'never' or "
                      f"{{'always': {{...}}, 'never': {{...}}}}, got {value!r}",
                      param=f"{where}.require_approval")


def _filter(value: Any, where: str) -> ToolFilter:
    """A tool filter: a list of names, or `{"tool_names": [...], "read_only": bool}`."""
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return ToolFilter(frozenset(value))
    if isinstance(value, Mapping) and set(value) <= {"tool_names", "read_only"}:
        names = value.get("tool_names")
        read_only = value.get("read_only")
        names_ok = names is None or (isinstance(names, list)
                                     and all(isinstance(n, str) for n in names))
        if names_ok and isinstance(read_only, (bool, type(None))):
            return ToolFilter(None if names is None else frozenset(names), bool(read_only))
    raise OpenAIError(f"{where}: expected a list of tool names or {{'tool_names': [...], "
                      f"'read_only': bool}}", param=where)


def _headers(raw: Mapping[str, Any], where: str) -> dict[str, str]:
    headers = raw.get("headers") or {}
    if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise OpenAIError(f"{where}.headers: expected an object of strings", param=where)
    out = dict(headers)
    token = raw.get("authorization")
    if token is not None:
        if not isinstance(token, str):
            raise OpenAIError(f"{where}.authorization: expected a string", param=where)
        out["Authorization"] = f"Bearer {token}"
    return out


def _allowed_tools(raw: Mapping[str, Any], where: str) -> tuple[frozenset[str] | None, bool]:
    value = raw.get("allowed_tools")
    if value is None:
        return None, False
    f = _filter(value, f"{where}.allowed_tools")
    return f.tool_names, f.read_only
