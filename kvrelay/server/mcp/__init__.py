"""MCP tools in `/v1/responses`: `tools: [{"type": "mcp", ...}]`, run by the server.

- `servers.py`: the operator's allowlist (`--tool-server`) and a request's MCP entries
  checked against it (no other URL is ever connected to).
- `client.py`: one MCP operation (list the tools, call one) over streamable HTTP with the
  `mcp` SDK, within a timeout; every failure becomes a value, never an exception.
- `setup.py`: a request's servers listed (`mcp_list_tools` items) and their tools offered to
  the model as harmony functions.
- `loop.py`: the tool loop — generate, call the MCP tools the model called (`mcp_call`
  items; `mcp_approval_request` items where the server's `require_approval` asks) and
  gpt-oss's built-in browser / python (`web_search_call` / `code_interpreter_call` items,
  on the `--tool-server` entries labelled so), feed the results back, generate again —
  whole, streamed or in the background.

Light at import: the `mcp` SDK is imported only when a request uses an MCP server.
"""
