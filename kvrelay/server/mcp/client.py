"""One MCP operation — list a server's tools, or call one — within a timeout.

Each operation is its own MCP session over streamable HTTP (the `mcp` SDK's client, on an
HTTP client that ignores proxy variables and whose redirects the SDK keeps on the server's
origin), opened and closed inside the timeout, so a slow or dead server costs at most
`timeout_s` and leaves nothing open. Nothing here raises for the server's sake: a failure
is a `Listing.error` (text, as OpenAI's `mcp_list_tools.error`) or a `CallOutcome.error`
(OpenAI's `mcp_call.error` objects: `mcp_protocol_error` {code, message},
`mcp_tool_execution_error` {content}, `http_error` {code, message}).

A tool's result is bounded: its text is cut at `max_output_bytes` (UTF-8, the cut said at
its end) before the model sees it, and no HTTP answer of the server is read past
`wire_limit(max_output_bytes)` bytes (the call fails as an `http_error` 502), so a server
that answers megabytes costs neither the context nor the memory.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvrelay.server.mcp.servers import McpServerRef

logger = logging.getLogger(__name__)

T = TypeVar("T")
INVALID_PARAMS = -32602            # JSON-RPC's "invalid params"
DEFAULT_MAX_OUTPUT_BYTES = 64 << 10


def wire_limit(max_output_bytes: int) -> int:
    """The most bytes one HTTP answer of an MCP server may take: room for a result of
    `max_output_bytes` in JSON (escapes, other content parts) plus the rest of the message."""
    return 16 * max_output_bytes + (1 << 20)


class AnswerTooLarge(Exception):
    """An MCP server's HTTP answer ran past the wire limit (it is not read further)."""


def cut(text: str, max_bytes: int) -> str:
    """`text` within `max_bytes` of UTF-8, the cut said at its end (as the model sees it)."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    note = (f"\n[kvrelay: the tool's output was cut from {len(data)} to {max_bytes} bytes "
            f"(--tool-server-max-output-bytes)]")
    keep = data[:max(max_bytes - len(note.encode()), 0)].decode("utf-8", "ignore")
    return keep + note


@dataclass(frozen=True)
class ListedTool:
    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None

    def as_item(self) -> dict[str, Any]:
        """As an `mcp_list_tools` item shows it."""
        return {"name": self.name, "description": self.description,
                "input_schema": self.input_schema, "annotations": self.annotations}


@dataclass(frozen=True)
class Listing:
    tools: tuple[ListedTool, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class CallOutcome:
    output: str | None = None
    error: dict[str, Any] | None = None


async def list_tools(server: McpServerRef, timeout_s: float,
                     max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> Listing:
    """The server's tools (every page), or why they could not be listed."""
    async def run(client: Any) -> Listing:
        tools: list[ListedTool] = []
        cursor = None
        for _ in range(100):                 # pages; a server that never ends is cut here
            page = await client.list_tools(cursor=cursor)
            tools.extend(_listed(t) for t in page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return Listing(tuple(tools))
    try:
        return await _session(server, timeout_s, run, wire_limit(max_output_bytes))
    except Exception as e:               # noqa: BLE001 — every failure is the item's error
        return Listing(error=_describe(_leaf(e), timeout_s))


async def call_tool(server: McpServerRef, name: str, arguments: str, timeout_s: float,
                    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                    code_key: str | None = None) -> CallOutcome:
    """`name(arguments)` on the server: its output text (cut at `max_output_bytes`), or an
    error object. `code_key`: the arguments are the text of that one argument (gpt-oss's
    python tool writes code, not JSON)."""
    args: Any
    if code_key is not None:
        args = {code_key: arguments}
    else:
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            args = e
    if not isinstance(args, dict):
        return CallOutcome(error={"type": "mcp_protocol_error", "code": INVALID_PARAMS,
                                  "message": f"the arguments are not a JSON object: "
                                             f"{arguments[:200]!r}"})

    async def run(client: Any) -> CallOutcome:
        result = await client.call_tool(name, args)
        content = [c.model_dump(mode="json", exclude_none=True) for c in result.content]
        if result.is_error:
            return CallOutcome(error={"type": "mcp_tool_execution_error",
                                      "content": _cut_content(content, max_output_bytes)})
        return CallOutcome(output=cut(_output_text(content, result.structured_content),
                                      max_output_bytes))
    try:
        return await _session(server, timeout_s, run, wire_limit(max_output_bytes))
    except Exception as e:               # noqa: BLE001 — every failure is the item's error
        return CallOutcome(error=_error_object(_leaf(e), timeout_s))


def _cut_content(content: list[dict[str, Any]], max_bytes: int) -> list[dict[str, Any]]:
    """An error's content parts within `max_bytes` (as one text part when larger)."""
    text = json.dumps(content, ensure_ascii=False)
    if len(text.encode("utf-8")) <= max_bytes:
        return content
    return [{"type": "text", "text": cut(_output_text(content, None), max_bytes)}]


async def _session(server: McpServerRef, timeout_s: float,
                   work: Callable[[Any], Awaitable[T]], limit: int) -> T:
    """`work(client)` in a fresh MCP session with `server`, all within `timeout_s`, no HTTP
    answer read past `limit` bytes."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    async with asyncio.timeout(timeout_s):
        async with httpx2.AsyncClient(headers=server.headers, trust_env=False,
                                      timeout=httpx2.Timeout(timeout_s),
                                      transport=_capped_transport(limit)) as http:
            transport = streamable_http_client(server.url, http_client=http)
            async with Client(transport, cache=None) as client:
                return await work(client)


def _capped_transport(limit: int) -> Any:
    """httpx2's transport, each answer's body read at most to `limit` bytes (then
    `AnswerTooLarge`: the connection is dropped, nothing more is buffered)."""
    import httpx2

    class Capped(httpx2.AsyncByteStream):
        def __init__(self, inner: Any) -> None:
            self.inner, self.seen = inner, 0

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self.inner:
                self.seen += len(chunk)
                if self.seen > limit:
                    raise AnswerTooLarge(f"the MCP server's answer is larger than {limit} "
                                         f"bytes; not read (--tool-server-max-output-bytes)")
                yield chunk

        async def aclose(self) -> None:
            await self.inner.aclose()

    class Transport(httpx2.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx2.AsyncHTTPTransport(trust_env=False)

        async def handle_async_request(self, request: Any) -> Any:
            response = await self.inner.handle_async_request(request)
            response.stream = Capped(response.stream)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    return Transport()


def _listed(tool: Any) -> ListedTool:
    annotations = tool.annotations.model_dump(mode="json", exclude_none=True, by_alias=True) \
        if tool.annotations is not None else None
    return ListedTool(tool.name, tool.description, dict(tool.input_schema or {}), annotations)


def _output_text(content: list[dict[str, Any]], structured: Any) -> str:
    """A result as `mcp_call.output`: its text parts joined; other parts as JSON; a result
    with only structured content as that JSON."""
    if not content and structured is not None:
        return json.dumps(structured, ensure_ascii=False)
    return "".join(c["text"] if c.get("type") == "text" else json.dumps(c, ensure_ascii=False)
                   for c in content)


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside the SDK's (nested) exception groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = next((x for x in e.exceptions if not isinstance(x, asyncio.CancelledError)),
                 e.exceptions[0])
    return e


def _describe(e: BaseException, timeout_s: float) -> str:
    err = _error_object(e, timeout_s)
    return f"{err['message']} ({err['type']} {err['code']})"


def _error_object(e: BaseException, timeout_s: float) -> dict[str, Any]:
    from mcp.shared.exceptions import MCPError
    if isinstance(e, TimeoutError):
        return {"type": "http_error", "code": 504,
                "message": f"the MCP server did not answer within {timeout_s:g} s "
                           f"(--tool-server-timeout)"}
    if isinstance(e, MCPError):
        return {"type": "mcp_protocol_error", "code": e.code, "message": e.message}
    status = getattr(getattr(e, "response", None), "status_code", None)
    message = str(e) or type(e).__name__
    if status is None:
        logger.info("MCP operation failed: %s: %s", type(e).__name__, message)
    return {"type": "http_error", "code": status if isinstance(status, int) else 502,
            "message": message}
