"""Function tools: validation of `tools` / `tool_choice`, call ids, and the serve flags.

Both API shapes are read: Chat Completions' `{"type": "function", "function": {name,
description, parameters}}` and the Responses API's flat `{"type": "function", name,
description, parameters}`. Everything downstream (harmony rendering, chat templates,
the grammar constraint) sees `FunctionTool`s and one `ToolChoice`.

Server options (`AgentOptions`) carry vLLM's flags `--enable-auto-tool-choice`,
`--tool-call-parser openai` and `--reasoning-parser openai_gptoss`: as in vLLM,
`tool_choice: "auto"` on /v1/chat/completions needs the first two — for template models.
A harmony (gpt-oss) model's chat format carries its calls (the commentary channel,
`to=functions.NAME`), so "auto" needs no flag there.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvrelay.server.protocol import OpenAIError
from kvrelay.structured import limits

if TYPE_CHECKING:
    from kvrelay.server.options import ToolServer

TOOL_CALL_PARSERS = ("openai",)          # gpt-oss's harmony calls (vLLM's name)
REASONING_PARSERS = ("openai_gptoss",)   # gpt-oss's analysis channel (vLLM's name)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass(frozen=True)
class AgentOptions:
    """The serve flags of tool calling, reasoning and the Responses API store."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    responses_store_size: int = 1000      # 0: no store (store / previous_response_id refused)
    responses_store_max_bytes: int = 256 << 20       # all entries (response_store.py)
    responses_store_max_entry_bytes: int = 16 << 20  # one entry; larger ones are not kept
    responses_owner_header: str | None = None        # who owns a stored response (else the key)
    responses_store_path: str | None = None          # SQLite file of the store; None: memory
    # MCP tools in /v1/responses (kvrelay/server/mcp/): the servers a request may use
    # (--tool-server: options.ToolServer entries), each operation's timeout, and the
    # MCP calls one response may make
    tool_servers: tuple[ToolServer, ...] = ()
    tool_server_timeout_s: float = 30.0
    tool_server_max_calls: int = 16
    # bytes of one MCP tool result fed back to the model (longer: cut, the cut said in the
    # text); an answer far larger than that is not read at all (mcp/client.py)
    tool_server_max_output_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser: only {', '.join(TOOL_CALL_PARSERS)!s} (gpt-oss "
                             f"harmony) is supported, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: only {', '.join(REASONING_PARSERS)} (gpt-oss "
                             f"harmony) is supported, got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.responses_store_size < 0:
            raise ValueError(f"responses store size must be >= 0, got {self.responses_store_size}")
        if self.responses_store_max_bytes < 1 or self.responses_store_max_entry_bytes < 1:
            raise ValueError("responses store byte limits must be >= 1 (KVRELAY_RESPONSES_STORE_"
                             "MAX_BYTES / _MAX_ENTRY_BYTES)")
        if self.responses_owner_header is not None and not re.fullmatch(
                r"[A-Za-z0-9-]{1,64}", self.responses_owner_header):
            raise ValueError(f"--responses-owner-header: expected an HTTP header name, got "
                             f"{self.responses_owner_header!r}")
        if not self.tool_server_timeout_s > 0:
            raise ValueError(f"--tool-server-timeout: expected seconds > 0, got "
                             f"{self.tool_server_timeout_s}")
        if self.tool_server_max_calls < 1:
            raise ValueError(f"--tool-server-max-calls: expected >= 1, got "
                             f"{self.tool_server_max_calls}")
        if self.tool_server_max_output_bytes < 256:
            raise ValueError(f"--tool-server-max-output-bytes: expected >= 256, got "
                             f"{self.tool_server_max_output_bytes}")

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        """The Chat Completions shape (what harmony rendering and chat templates read)."""
        fn: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    def as_response_tool(self) -> dict[str, Any]:
        """The Responses API shape (echoed in a response's `tools`)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


@dataclass(frozen=True)
class ToolChoice:
    """mode: "auto" (the model decides), "none" (no call: tools are left out of the prompt),
    "required" (at least one call), "named" (a call of `name`)."""
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None

    def as_response_value(self) -> str | dict[str, Any]:
        if self.mode == "named":
            return {"type": "function", "name": self.name}
        return self.mode

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools with its choice; `offered` are the tools the prompt shows.
    `parallel`: `parallel_tool_calls` (default true); false → at most one call an answer.
    `builtin`: gpt-oss's built-in tools (`browser`, `python`) the prompt describes and whose
    calls the server runs (Responses with MCP tool servers: kvrelay/server/mcp/)."""
    tools: tuple[FunctionTool, ...] = ()
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True
    builtin: frozenset[str] = frozenset()

    def limit(self, calls: list[ToolCallOut]) -> list[ToolCallOut]:
        """`calls` as the answer may hold them: the first only under parallel_tool_calls
        false."""
        return calls if self.parallel else calls[:1]

    @property
    def offered(self) -> tuple[FunctionTool, ...]:
        return () if self.choice.mode == "none" else self.tools

    @property
    def parse_calls(self) -> bool:
        """Whether the output's calls are returned as tool calls."""
        return bool(self.tools) and self.choice.mode != "none"

    def tool(self, name: str) -> FunctionTool:
        return next(t for t in self.tools if t.name == name)


NO_TOOLS = ToolSpec()


def parse_tools(raw: Any, param: str = "tools") -> tuple[FunctionTool, ...]:
    """Validates `tools` (either API shape); a 400 naming the bad entry otherwise."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise OpenAIError(f"{param}: expected a list of function tools", param=param)
    out: list[FunctionTool] = []
    for i, tool in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise OpenAIError(f"{where}: only function tools ({{\"type\": \"function\"}}) are "
                              f"supported, got {kind!r}", param=where)
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping):
            raise OpenAIError(f"{where}.function: expected an object", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise OpenAIError(f"{where}.name: expected 1-64 letters, digits, '_', '-' or '.', "
                              f"got {name!r}", param=where)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise OpenAIError(f"{where}.parameters: expected a JSON schema object", param=where)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise OpenAIError(f"{where}.description: expected a string", param=where)
        strict = fn.get("strict")
        out.append(FunctionTool(name, description, dict(params) if params is not None else None,
                                strict if isinstance(strict, bool) else None))
    names = [t.name for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise OpenAIError(f"{param}: duplicate function names {dupes}", param=param)
    try:        # how many, and their schemas' size and shape (kvrelay/structured/limits.py)
        limits.check_tools([(t.name, t.parameters) for t in out])
    except ValueError as e:
        raise OpenAIError(f"{param}: {e}", param=param) from None
    return tuple(out)


def parse_tool_choice(raw: Any, tools: Sequence[FunctionTool],
                      param: str = "tool_choice") -> ToolChoice:
    """`"auto" | "none" | "required"`, `{"type": "function", "function": {"name": N}}` (chat)
    or `{"type": "function", "name": N}` (responses). Default: auto with tools, else none."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise OpenAIError(f"{param}: expected 'auto', 'none', 'required' or a named function, "
                              f"got {raw!r}", param=param)
        if raw == "required" and not tools:
            raise OpenAIError(f"{param}: 'required' needs at least one tool in 'tools'",
                              param=param)
        return {"auto": ToolChoice("auto"), "none": ToolChoice("none"),
                "required": ToolChoice("required")}[raw]
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        fn = raw.get("function", raw)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str):
            raise OpenAIError(f"{param}.function.name: expected a string", param=param)
        if name not in {t.name for t in tools}:
            raise OpenAIError(f"{param}: function {name!r} is not in 'tools' "
                              f"({', '.join(t.name for t in tools) or 'none given'})", param=param)
        return ToolChoice("named", name)
    raise OpenAIError(f"{param}: expected 'auto', 'none', 'required' or "
                      f"{{'type': 'function', 'function': {{'name': ...}}}}, got {raw!r}",
                      param=param)


def tool_spec(tools: Any, choice: Any, parallel: Any = None) -> ToolSpec:
    """`tools`, `tool_choice` and `parallel_tool_calls` (None: true) of a request."""
    parsed = parse_tools(tools)
    if parallel is not None and not isinstance(parallel, bool):
        raise OpenAIError("parallel_tool_calls: expected a boolean", param="parallel_tool_calls")
    return ToolSpec(parsed, parse_tool_choice(choice, parsed), parallel is not False)


def new_call_id() -> str:
    """OpenAI's shape of a tool call id: `call_` and 24 characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallOut:
    """One call the model made, as the APIs return it."""
    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_chat(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# ------------------------------------------------------------------ template models


def calls_from_json_array(text: str) -> list[ToolCallOut] | None:
    """A template model's calls under a forced choice: vLLM's JSON list
    `[{"name": N, "parameters": {...}}, ...]` (what the grammar makes it write); None when
    the text is not such a list."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCallOut(item["name"], json.dumps(item.get("parameters", {}),
                                                          ensure_ascii=False)))
    return calls


def check_chat_tool_choice(tools: ToolSpec, options: AgentOptions) -> None:
    """vLLM's rule for /v1/chat/completions on a template model: `tool_choice: "auto"` (also
    implied by `tools` without a choice) needs `--enable-auto-tool-choice --tool-call-parser
    ...` (api.py does not ask it of harmony models, whose chat format carries the calls)."""
    if tools.tools and tools.choice.mode == "auto" and not options.auto_tools:
        raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")
