"""Small MCP servers for the MCP tests, written with the `mcp` SDK (MCPServer, FastMCP's name
in mcp 2), over streamable HTTP on 127.0.0.1:
- `build()` ("calc"): `add(a, b)`, `echo(text)`, `slow(seconds)` (answers after sleeping)
  and `fail(text)` (always raises);
- `build_builtin()` ("builtin"): gpt-oss's browser as `search(query, topn)`, `open(id)`,
  `find(pattern)` (canned pages; `search("flood:N")` answers N bytes, a hostile server),
  and `python(code)` (evaluates one expression: no sandbox, tests only; "sleep:S" sleeps);
- `build_weather(seen)` ("weather"): `get_weather(city)` answers "sunny" and appends its
  arguments to `seen` (the call the scripted gpt-oss of tests/agent/scripted.py makes);

- `McpThread(port)`: served by uvicorn in a thread of the test process (the in-process
  tests, which start no process);
- `McpProcess(port, log)`: `python -m tests.agent.mcp_server PORT` in its own process,
  stopped by PID (the end-to-end test).
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def build(name: str = "calc") -> MCPServer:
    mcp: MCPServer = MCPServer(name, instructions="Arithmetic and echo, for kvrelay's tests.",
                               log_level="WARNING")

    @mcp.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @mcp.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @mcp.tool()
    async def slow(seconds: float) -> str:
        """Answer after `seconds`."""
        await asyncio.sleep(seconds)
        return "slept"

    @mcp.tool()
    def fail(text: str) -> str:
        """Always fails."""
        raise ToolError(f"fail was asked to fail: {text}")

    return mcp


def build_builtin() -> MCPServer:
    mcp: MCPServer = MCPServer("builtin", log_level="WARNING")

    @mcp.tool()
    def search(query: str, topn: int = 10) -> str:
        """Search the web."""
        if query.startswith("flood:"):
            return "x" * int(query[6:])
        return f"[0] Result for {query}: the sky is blue (https://example.com/sky)"

    @mcp.tool()
    def open(id: int | str = -1, cursor: int = -1) -> str:
        """Open a page."""
        return f"page {id}: the sky is blue because of Rayleigh scattering"

    @mcp.tool()
    def find(pattern: str, cursor: int = -1) -> str:
        """Find a pattern on the page."""
        return f"found {pattern!r} at L3"

    @mcp.tool()
    async def python(code: str) -> str:
        """Run Python code."""
        if code.startswith("sleep:"):
            await asyncio.sleep(float(code[6:]))
            return "slept"
        return repr(eval(code, {"__builtins__": {}}))

    return mcp


def build_weather(seen: list[dict[str, Any]]) -> MCPServer:
    mcp: MCPServer = MCPServer("weather", log_level="WARNING")

    @mcp.tool()
    def get_weather(city: str) -> str:
        """Weather now in a city."""
        seen.append({"city": city})
        return "sunny"

    return mcp


def _wait_listening(port: int, alive, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the MCP server stopped before it listened")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"the MCP server did not listen on {port} within {timeout}s")


class McpThread:
    """The test server in a thread (uvicorn, lifespan on: it starts the session manager)."""

    def __init__(self, port: int, make: Callable[[], MCPServer] = build) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/mcp"
        app = make().streamable_http_app()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> McpThread:
        self.thread.start()
        _wait_listening(self.port, self.thread.is_alive)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class McpProcess:
    """The test server in its own process; `stop()` ends it by PID."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/mcp"
        self._log = open(log, "w")  # noqa: SIM115 -- closed by stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.agent.mcp_server", str(port)],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[2])

    def start(self) -> McpProcess:
        _wait_listening(self.port, lambda: self.proc.poll() is None)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


if __name__ == "__main__":
    build().run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
