"""A request's MCP servers, listed, and their tools offered to the model.

    tools: [{"type": "function", ...}, {"type": "mcp", "server_label": "calc", ...}]
      → each MCP entry checked against --tool-server (servers.resolve: 400 otherwise)
      → each server's tools listed, all at once, each within the timeout
        → one `mcp_list_tools` output item per server (its `error` when listing failed)
      → the allowed tools offered to the model as harmony functions (`namespace functions`,
        under their own names: what gpt-oss is trained to call, and what the grammar can
        force), beside the request's own functions; a name two of them share is a 400

A call of one of them (`to=functions.add`) is run by the server (loop.py); a call of the
request's own functions is returned to the client as usual.
"""
from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrelay.server.mcp.client import ListedTool, Listing, list_tools
from kvrelay.server.mcp.servers import McpServerRef, is_mcp, resolve
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.tools import ToolSpec, parse_tools, tool_spec

if TYPE_CHECKING:
    from kvrelay.server.tools import AgentOptions

# a name harmony can address as `functions.NAME` (as kvrelay/server/tools.py accepts)
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class McpSetup:
    """One request's MCP servers and the tools they offer (owner: the request)."""
    servers: tuple[McpServerRef, ...]
    list_items: tuple[dict[str, Any], ...]          # the mcp_list_tools output items
    offered: Mapping[str, tuple[McpServerRef, ListedTool]]   # function name → its server
    functions: tuple[Any, ...]                      # the request's own function tools (raw)
    choice: Any                                     # tool_choice, an MCP one as a function's
    choice_sent: Any                                # tool_choice as the request sent it
    timeout_s: float
    max_calls: int                                  # MCP calls one response may make

    def server_of(self, name: str) -> McpServerRef | None:
        found = self.offered.get(name)
        return found[0] if found is not None else None

    def tool_spec(self, parallel: Any) -> ToolSpec:
        """The request's functions and the MCP tools, as one ToolSpec."""
        mcp = [{"type": "function", "name": name, "description": tool.description or "",
                "parameters": tool.input_schema} for name, (_, tool) in self.offered.items()]
        return tool_spec([*self.functions, *mcp] or None, self.choice, parallel)

    def echo_tools(self, spec: ToolSpec) -> list[dict[str, Any]]:
        """`tools` as a response shows them: the request's functions and MCP entries."""
        own = [t.as_response_tool() for t in spec.tools if t.name not in self.offered]
        return own + [s.as_response_tool() for s in self.servers]


async def open_setup(body: Any, options: AgentOptions) -> McpSetup | None:
    """The MCP side of a Responses request (None when it names no MCP server): checks it
    (400s), then lists every server's tools."""
    raw = body.tools
    if not isinstance(raw, list) or not any(is_mcp(t) for t in raw):
        return None
    if body.background:
        raise OpenAIError("MCP tools do not run in background responses yet; send the request "
                          "without background", param="background")
    servers = tuple(resolve(t, f"tools[{i}]", options.tool_servers)
                    for i, t in enumerate(raw) if is_mcp(t))
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise OpenAIError("tools: two MCP entries have the same server_label", param="tools")
    functions = tuple(t for t in raw if not is_mcp(t))
    own = {t.name for t in parse_tools(list(functions))}      # checked before any connection
    timeout = options.tool_server_timeout_s
    listings = await asyncio.gather(*(list_tools(s, timeout) for s in servers))
    offered = _offered(servers, listings, own)
    max_calls = options.tool_server_max_calls
    if body.max_tool_calls is not None:
        max_calls = min(max_calls, body.max_tool_calls)
    return McpSetup(servers, tuple(_list_item(s, x) for s, x in zip(servers, listings)),
                    offered, functions, _choice(body.tool_choice, servers, offered),
                    body.tool_choice, timeout, max_calls)


def _list_item(server: McpServerRef, listing: Listing) -> dict[str, Any]:
    return {"type": "mcp_list_tools", "id": f"mcpl_{uuid.uuid4().hex}",
            "server_label": server.label,
            "tools": [t.as_item() for t in listing.tools if server.allows(t.name, t.annotations)],
            "error": listing.error}


def _offered(servers: tuple[McpServerRef, ...], listings: list[Listing],
             own: set[str]) -> dict[str, tuple[McpServerRef, ListedTool]]:
    """Function name → (server, tool) for every allowed tool; 400 on a name two share."""
    offered: dict[str, tuple[McpServerRef, ListedTool]] = {}
    for server, listing in zip(servers, listings):
        for tool in listing.tools:
            if not (server.allows(tool.name, tool.annotations)
                    and _FUNCTION_NAME.match(tool.name)):
                continue                 # filtered out, or a name harmony cannot address
            other = "the request's functions" if tool.name in own else \
                f"MCP server {offered[tool.name][0].label!r}" if tool.name in offered else None
            if other is not None:
                raise OpenAIError(f"tools: MCP server {server.label!r} offers a tool named "
                                  f"{tool.name!r}, as does {other}; leave one out with "
                                  f"allowed_tools", param="tools")
            offered[tool.name] = (server, tool)
    return offered


def _choice(choice: Any, servers: tuple[McpServerRef, ...],
            offered: Mapping[str, tuple[McpServerRef, ListedTool]]) -> Any:
    """OpenAI's `{"type": "mcp", "server_label": L, "name": N}` → the function choice of N
    (without a name: of the server's only tool). Other choices are left as they are."""
    if not (isinstance(choice, Mapping) and choice.get("type") == "mcp"):
        return choice
    label, name = choice.get("server_label"), choice.get("name")
    if label not in {s.label for s in servers}:
        raise OpenAIError(f"tool_choice.server_label: {label!r} is not an MCP server of "
                          f"'tools'", param="tool_choice")
    names = [n for n, (s, _) in offered.items() if s.label == label]
    if name is None and len(names) == 1:
        name = names[0]
    if name not in names:
        raise OpenAIError(f"tool_choice.name: expected one of MCP server {label!r}'s tools "
                          f"{names}, got {name!r}", param="tool_choice")
    return {"type": "function", "name": name}
