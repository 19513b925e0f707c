"""A request's MCP servers, listed, and their tools offered to the model.

    tools: [{"type": "function", ...}, {"type": "mcp", "server_label": "calc", ...},
            {"type": "web_search_preview"}, {"type": "code_interpreter", ...}]
      → each MCP entry checked against --tool-server (servers.resolve: 400 otherwise); a
        built-in tool entry → the --tool-server entry labelled `browser` / `python`
      → each server's tools listed, all at once, each within the timeout
        → one `mcp_list_tools` output item per MCP entry (its `error` when listing failed);
          a built-in's server must list its tools (browser: search, open, find; python: one)
      → the allowed tools offered to the model as harmony functions (`namespace functions`,
        under their own names: what gpt-oss is trained to call, and what the grammar can
        force), beside the request's own functions; a name two of them share is a 400; the
        built-ins described in the harmony system message (`## browser`, `## python`)
      → the input's `mcp_approval_response` items matched with the approval requests they
        answer (in the previous response's output, or the input): unknown ids are a 400

A call of one of them (`to=functions.add`, `to=browser.search`) is run by the server
(loop.py); a call of the request's own functions is returned to the client as usual.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrelay.server.mcp.client import ListedTool, Listing, list_tools
from kvrelay.server.mcp.servers import (
    McpServerRef,
    builtin_namespace,
    is_mcp,
    resolve,
    resolve_builtin,
)
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.tools import ToolSpec, parse_tools, tool_spec

if TYPE_CHECKING:
    from kvrelay.server.response_store import ResponseStore
    from kvrelay.server.tools import AgentOptions

# a name harmony can address as `functions.NAME` (as kvrelay/server/tools.py accepts)
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BROWSER_TOOLS = ("search", "open", "find")      # harmony's `namespace browser`


@dataclass(frozen=True)
class Builtin:
    """A built-in tool's recipient (`browser.search`, `python`) served by an MCP tool."""
    server: McpServerRef
    tool: str                   # the MCP tool's name
    code_key: str | None = None  # python: the argument that takes the code (else JSON args)


@dataclass(frozen=True)
class Approval:
    """An `mcp_approval_response` of the input, and the request it answers."""
    request: dict[str, Any]                         # the mcp_approval_request item
    approve: bool
    reason: str | None = None


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
    max_output_bytes: int = 64 << 10                # of one tool result fed back
    builtins: Mapping[str, Builtin] = dataclasses.field(default_factory=dict)  # recipient →
    builtin_tools: tuple[Any, ...] = ()             # the request's built-in entries (raw)
    approvals: tuple[Approval, ...] = ()            # the input's approval responses
    # approval_request_id → what stands in the conversation for an answered call
    # (responses.input_messages): a declined call and why, or None (approved: made now)
    stand_ins: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def server_of(self, name: str) -> McpServerRef | None:
        found = self.offered.get(name)
        return found[0] if found is not None else None

    def asks(self, name: str) -> bool:
        """Whether a call of the MCP tool `name` waits for the client's approval."""
        server, tool = self.offered[name]
        return server.asks(name, tool.annotations)

    def tool_spec(self, parallel: Any) -> ToolSpec:
        """The request's functions and the MCP tools, as one ToolSpec (with the built-ins)."""
        mcp = [{"type": "function", "name": name, "description": tool.description or "",
                "parameters": tool.input_schema} for name, (_, tool) in self.offered.items()]
        spec = tool_spec([*self.functions, *mcp] or None, self.choice, parallel)
        builtin = frozenset(r.split(".")[0] for r in self.builtins)
        return dataclasses.replace(spec, builtin=builtin) if builtin else spec

    def echo_tools(self, spec: ToolSpec) -> list[dict[str, Any]]:
        """`tools` as a response shows them: the request's functions, MCP entries and
        built-in tools."""
        own = [t.as_response_tool() for t in spec.tools if t.name not in self.offered]
        return own + [s.as_response_tool() for s in self.servers] + \
            [dict(t) for t in self.builtin_tools]


def _approval_items(raw: Any) -> list[tuple[int, Mapping[str, Any]]]:
    if not isinstance(raw, list):
        return []
    return [(i, t) for i, t in enumerate(raw)
            if isinstance(t, Mapping) and t.get("type") == "mcp_approval_response"]


async def open_setup(body: Any, options: AgentOptions, store: ResponseStore | None = None,
                     owner: str = "") -> McpSetup | None:
    """The MCP side of a Responses request (None when it names no MCP server nor built-in
    tool): checks it (400s), then lists every server's tools."""
    raw = body.tools
    if not isinstance(raw, list) or not any(is_mcp(t) or builtin_namespace(t) for t in raw):
        return None
    servers = tuple(resolve(t, f"tools[{i}]", options.tool_servers)
                    for i, t in enumerate(raw) if is_mcp(t))
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise OpenAIError("tools: two MCP entries have the same server_label", param="tools")
    inner = [(i, t) for i, t in enumerate(raw) if builtin_namespace(t)]
    namespaces = [builtin_namespace(t) for _, t in inner]
    if len(set(namespaces)) != len(namespaces):
        raise OpenAIError("tools: a built-in tool is given twice", param="tools")
    inner_servers = [resolve_builtin(t, f"tools[{i}]", options.tool_servers) for i, t in inner]
    functions = tuple(t for t in raw if not is_mcp(t) and not builtin_namespace(t))
    own = {t.name for t in parse_tools(list(functions))}      # checked before any connection
    timeout = options.tool_server_timeout_s
    listings = await asyncio.gather(*(list_tools(s, timeout)
                                      for s in (*servers, *inner_servers)))
    builtins: dict[str, Builtin] = {}
    for (i, _), server, listing in zip(inner, inner_servers, listings[len(servers):]):
        builtins.update(_builtin(server, listing, f"tools[{i}]"))
    listings = listings[:len(servers)]
    offered = _offered(servers, listings, own)
    max_calls = options.tool_server_max_calls
    if body.max_tool_calls is not None:
        max_calls = min(max_calls, body.max_tool_calls)
    setup = McpSetup(servers, tuple(_list_item(s, x) for s, x in zip(servers, listings)),
                     offered, functions, _choice(body.tool_choice, servers, offered),
                     body.tool_choice, timeout, max_calls, options.tool_server_max_output_bytes,
                     builtins, tuple(t for _, t in inner))
    answers = _approval_items(body.input)
    if answers:
        previous: list[Any] = []
        if body.previous_response_id is not None and store is not None and store.enabled:
            found = await asyncio.to_thread(store.get, body.previous_response_id, owner)
            previous = list(found.body.get("output") or []) if found is not None else []
        setup = _approvals(setup, answers, previous, body.input)
    return setup


def _builtin(server: McpServerRef, listing: Listing, where: str) -> dict[str, Builtin]:
    """A built-in's recipients → the MCP tools that serve them; 400 when the server does
    not list them (502 when it could not be listed)."""
    if listing.error is not None:
        raise OpenAIError(f"{where}: the {server.label} tool server ({server.url}) could not be "
                          f"listed: {listing.error}", 502, "server_error", where)
    tools = {t.name: t for t in listing.tools}
    if server.label == "browser":
        missing = [n for n in BROWSER_TOOLS if n not in tools]
        if missing:
            raise OpenAIError(f"{where}: the browser tool server ({server.url}) lists no "
                              f"{', '.join(missing)} tool (it needs search, open and find)",
                              param=where)
        return {f"browser.{n}": Builtin(server, n) for n in BROWSER_TOOLS}
    tool = tools.get("python") or (listing.tools[0] if len(listing.tools) == 1 else None)
    if tool is None:
        raise OpenAIError(f"{where}: the python tool server ({server.url}) must list one tool, "
                          f"or one named 'python'; it lists {sorted(tools)}", param=where)
    props = tool.input_schema.get("properties")
    strings = [k for k, v in (props or {}).items() if isinstance(v, Mapping)
               and v.get("type") == "string"] if isinstance(props, Mapping) else []
    key = "code" if "code" in strings or len(strings) != 1 else strings[0]
    return {"python": Builtin(server, tool.name, key)}


def _approvals(setup: McpSetup, answers: list[tuple[int, Mapping[str, Any]]],
               previous: list[Any], raw_input: list[Any]) -> McpSetup:
    """The input's approval responses matched with their requests (the previous response's
    output, or items of the input): a 400 for an id nobody asked, one answered twice or
    already, or a tool this request no longer offers."""
    asked = {it.get("id"): it for it in [*previous, *raw_input] if isinstance(it, Mapping)
             and it.get("type") == "mcp_approval_request"}
    answered = {it.get("approval_request_id") for it in previous
                if isinstance(it, Mapping) and it.get("type") == "mcp_call"}
    approvals: list[Approval] = []
    stand_ins: dict[str, Any] = {}
    for i, item in answers:
        where = f"input[{i}]"
        rid, approve, reason = (item.get("approval_request_id"), item.get("approve"),
                                item.get("reason"))
        if not isinstance(rid, str) or not isinstance(approve, bool) \
                or not isinstance(reason, (str, type(None))):
            raise OpenAIError(f"{where}: an mcp_approval_response needs 'approval_request_id' "
                              f"(a string) and 'approve' (a boolean)", param=where)
        request = asked.get(rid)
        if request is None:
            raise OpenAIError(f"{where}.approval_request_id: no mcp_approval_request with id "
                              f"{rid!r} in the previous response or the input",
                              param=f"{where}.approval_request_id")
        if rid in stand_ins or rid in answered:
            raise OpenAIError(f"{where}.approval_request_id: {rid!r} is answered already",
                              param=f"{where}.approval_request_id")
        server = setup.server_of(str(request.get("name")))
        if approve and (server is None or server.label != request.get("server_label")):
            raise OpenAIError(f"{where}: the approved call is of {request.get('name')!r} on "
                              f"MCP server {request.get('server_label')!r}, which this request's "
                              f"tools do not offer", param=where)
        approvals.append(Approval(dict(request), approve, reason))
        stand_ins[rid] = None if approve else {
            "type": "mcp_call", "id": rid, "name": request.get("name"),
            "arguments": request.get("arguments"), "output": None,
            "error": {"message": "the user declined this call" + (f": {reason}" if reason
                                                                  else "")}}
    return dataclasses.replace(setup, approvals=tuple(approvals), stand_ins=stand_ins)


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
