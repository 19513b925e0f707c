"""`kvrelay serve`'s flags in one table, and the help formatter every kvrelay command uses.

The table (`SERVE_FLAGS`: groups of `Flag`) feeds both argparse (`add_flags`) and
docs/serving.md's flag table (`render_markdown`, between `<!-- flags:serve -->` and
`<!-- /flags:serve -->`), so `--help` and the docs cannot drift:

    python -m kvrelay.cli_flags              # exit 1 when the docs differ from the table
    python -m kvrelay.cli_flags --write      # regenerate the block in docs/serving.md

tests/unit/test_cli_help.py runs the check and also asserts that every flag of every
kvrelay command has a help text that shows its default.

Flags keep vLLM's names and meanings. Only the standard library is imported: `--help` and
flag errors come before torch.
"""
from __future__ import annotations

import argparse
import builtins
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("auto", "mxfp4", "none")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
BEGIN, END = "<!-- flags:serve -->", "<!-- /flags:serve -->"


def json_object(text: str) -> dict:
    """argparse type: a JSON object (a one-line error naming what is wrong)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def default_text(value: Any) -> str | None:
    """A default as `--help` and the docs show it; None when there is none to show
    (unset, off, empty)."""
    if value is None or value is False or value is argparse.SUPPRESS or value in ("", [], ()):
        return None
    if value is True:
        return "on"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already names it (or there
    is none: unset, off, empty). Descriptions and epilogs are printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "%(default)" in help_text or "(default" in help_text:
            return help_text
        shown = default_text(action.default)
        if shown is None:
            return help_text
        return f"{help_text} (default: {shown.replace('%', '%%')})"


@dataclass(frozen=True)
class Flag:
    """One flag: argparse's arguments plus `default_note`, what an unset (None) default
    means ("the checkpoint's max_position_embeddings"), shown by `--help` and the docs."""

    names: tuple[str, ...]                 # ("--tensor-parallel-size", "-tp"), or ("model",)
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    nargs: str | None = None
    metavar: str | None = None
    default_note: str | None = None

    @property
    def positional(self) -> bool:
        return not self.names[0].startswith("-")

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")

    def argparse_kwargs(self) -> dict[str, Any]:
        help_text = self.help
        if self.default_note and default_text(self.default) is None:
            help_text += f" (default: {self.default_note})"
        kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%"), "default": self.default}
        for name in ("type", "choices", "action", "nargs", "metavar"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(*self.names, **self.argparse_kwargs())

    # -- the docs' row
    def doc_name(self) -> str:
        if self.positional:
            return f"`{self.metavar or self.dest.upper()}` (positional)"
        if self.action == argparse.BooleanOptionalAction:
            long = self.names[0]
            return f"`{long}`, `--no-{long[2:]}`"
        value = ""
        if self.action is None:
            value = " " + (self.metavar or ("\\|".join(self.choices) if self.choices
                                            else self.dest.upper()))
            if self.nargs == "+":
                value += " …"
        first, *aliases = self.names
        return ", ".join([f"`{first}{value}`", *(f"`{a}`" for a in aliases)])

    def doc_default(self) -> str:
        shown = default_text(self.default)
        if shown is not None:
            return f"`{shown}`"
        if self.default_note:
            return self.default_note
        return "off" if self.action in ("store_true", argparse.BooleanOptionalAction) else "none"

    def doc_row(self) -> str:
        cells = [self.doc_name(), self.doc_default(), self.help]
        return "| " + " | ".join(c.replace("\n", " ") for c in cells) + " |"


@dataclass(frozen=True)
class FlagGroup:
    title: str
    flags: tuple[Flag, ...]


def add_flags(parser: argparse.ArgumentParser, groups: Sequence[FlagGroup]) -> None:
    """Every flag of `groups`, each group an argparse argument group (positionals first)."""
    for group in groups:
        for flag in group.flags:
            if flag.positional:
                flag.add_to(parser)
    for group in groups:
        section = parser.add_argument_group(group.title)
        for flag in group.flags:
            if not flag.positional:
                flag.add_to(section)


def render_markdown(groups: Sequence[FlagGroup]) -> str:
    """The docs' flag tables: one per group."""
    out: list[str] = []
    for group in groups:
        out += ["", f"**{group.title}**", "", "| flag | default | meaning |", "|---|---|---|"]
        out += [flag.doc_row() for flag in group.flags]
    return "\n".join(out[1:])


# ---------------------------------------------------------------------------- serve's flags

_F = Flag
SERVE_FLAGS: tuple[FlagGroup, ...] = (
    FlagGroup("Model", (
        _F(("model",), "checkpoint directory, or a Hugging Face repo id found in the HF cache "
                       "(nothing is downloaded)", nargs="?", metavar="MODEL",
           default_note="the embedded model"),
        _F(("--served-model-name",), "the model name(s) clients send in `model` and "
                                     "/v1/models lists", nargs="+", metavar="NAME",
           default_note="MODEL as given"),
        _F(("--dtype",), "weights and activations; auto: the checkpoint's torch_dtype "
                         "(bfloat16 when it names another)", default="auto", choices=DTYPES),
        _F(("--quantization",), "MoE experts: mxfp4 keeps them MXFP4-packed (the checkpoint "
                                "must hold MXFP4 tensors), none dequantises them to --dtype at "
                                "load, auto keeps an MXFP4 checkpoint packed",
           choices=QUANTIZATIONS, default_note="auto"),
        _F(("--hf-overrides",), "keys merged into config.json before the model is built",
           type=json_object, metavar="JSON"),
        _F(("--download-dir",), "the Hugging Face cache MODEL is looked up in",
           metavar="DIR", default_note="$HF_HUB_CACHE, else ~/.cache/huggingface/hub"),
        _F(("--max-model-len",), "longest prompt + output of a request, in tokens", type=int,
           metavar="N", default_note="config.json's max_position_embeddings"),
        _F(("--seed",), "seeds the engine's sampler: requests without their own seed repeat "
                        "from a server started with the same seed", default=0, type=int,
           metavar="N"),
        _F(("--device",), "where the model runs; auto: CUDA when available, else CPU",
           default="auto", choices=("auto", "cpu", "cuda")),
    )),
    FlagGroup("HTTP server", (
        _F(("--host",), "address to listen on (0.0.0.0: every interface)", default="127.0.0.1"),
        _F(("--port",), "HTTP port", default=8000, type=int),
        _F(("--api-key",), "clients must send 'Authorization: Bearer KEY' on /v1/*",
           metavar="KEY", default_note="none: no check"),
        _F(("--max-queued-requests",), "sequences that may wait beyond --max-num-seqs; past it "
                                       "503 + Retry-After", default=1024, type=int, metavar="N"),
        _F(("--max-seqs-per-request",), "prompts x n of one request; past it 400", default=256,
           type=int, metavar="N"),
        _F(("--forwarded-allow-ips",), "comma-separated proxy addresses (or '*') whose "
                                       "X-Forwarded-For/-Proto are trusted", metavar="IPS",
           default_note="none"),
        _F(("--responses-owner-header",), "header naming the client a stored response belongs "
                                          "to, set by a trusted gateway in front",
           metavar="NAME", default_note="the Authorization header"),
        _F(("--responses-store",), "where /v1/responses keeps stored responses: sqlite (a file "
                                   "under --state-dir, one per port: they survive a restart) "
                                   "or memory", default="sqlite", choices=("sqlite", "memory")),
        _F(("--state-dir",), "directory of the state kept across restarts (the responses "
                             "store)", metavar="DIR",
           default_note="$KVRELAY_STATE_DIR, else ~/.cache/kvrelay/state"),
    )),
    FlagGroup("Tools and reasoning (docs/agents.md)", (
        _F(("--enable-auto-tool-choice",), "let the model decide to call tools (tool_choice "
                                           "'auto' on chat)", action="store_true", default=False),
        _F(("--tool-call-parser",), "how tool calls are read from the output: 'openai' "
                                    "(gpt-oss harmony)", metavar="NAME", default_note="none"),
        _F(("--reasoning-parser",), "'openai_gptoss': reasoning from harmony's analysis "
                                    "channel (harmony checkpoints always split it)",
           metavar="NAME", default_note="none"),
        _F(("--tool-server",), "MCP servers /v1/responses' mcp tools may use, comma-separated "
                               "[LABEL=]host:port (its /mcp endpoint) or [LABEL=]URL; no "
                               "other URL is connected to", metavar="SERVERS",
           default_note="none: mcp tools are refused"),
        _F(("--tool-server-timeout",), "seconds one MCP operation (list the tools, call one) "
                                       "may take", default=30.0, type=float, metavar="S"),
        _F(("--tool-server-max-calls",), "MCP calls one response may make (a request's "
                                         "max_tool_calls may lower it)", default=16, type=int,
           metavar="N"),
        _F(("--tool-server-max-output-bytes",), "bytes of one MCP tool result fed back to the "
                                                "model (longer: cut, the cut said); an answer "
                                                "over 16x that + 1 MiB is not read", type=int,
           metavar="BYTES", default_note="$KVRELAY_TOOL_SERVER_MAX_OUTPUT_BYTES, else 65536"),
        _F(("--logits-processors",), "factories f(params, prompt_ids) -> logits processor, "
                                     "applied to every request", default=[], nargs="+",
           metavar="MODULE:ATTR", default_note="none"),
    )),
    FlagGroup("Scheduler and KV cache", (
        _F(("--max-num-seqs",), "sequences the engine runs at once (the batch)", default=256,
           type=int, metavar="N"),
        _F(("--max-num-batched-tokens",), "tokens one engine step may compute (prompt chunks "
                                          "and decodes together)", type=int, metavar="N",
           default_note="8192"),
        _F(("--block-size",), "tokens per KV-cache block", default=16, type=int, metavar="N"),
        _F(("--enable-prefix-caching",), "reuse the KV blocks of prompt prefixes computed "
                                         "before", default=True,
           action=argparse.BooleanOptionalAction),
        _F(("--disable-hybrid-kv-cache-manager",), "sliding-window layers keep every KV block "
                                                   "too (on: blocks that left the window are "
                                                   "not freed)", default=False,
           action=argparse.BooleanOptionalAction),
        _F(("--kv-cache-memory-bytes",), "bytes of KV cache", type=int, metavar="BYTES",
           default_note="1 GiB, at most what --max-num-seqs sequences of --max-model-len use"),
        _F(("--num-gpu-blocks-override",), "KV-cache blocks (wins over "
                                           "--kv-cache-memory-bytes)", type=int, metavar="N",
           default_note="from --kv-cache-memory-bytes"),
        _F(("--max-logprobs",), "most logprobs a request may ask for (-1: no limit, 0: none)",
           default=20, type=int, metavar="N"),
        _F(("--async-scheduling",), "plan the next step while the current one computes",
           action="store_true", default=False),
        _F(("--speculative-config",), "speculative decoding: {\"method\": \"ngram\", "
                                      "\"num_speculative_tokens\": K, \"prompt_lookup_max\": "
                                      "N, \"prompt_lookup_min\": M}: drafts copied from an "
                                      "earlier match of the last tokens; or {\"model\": "
                                      "DRAFT_DIR, \"num_speculative_tokens\": K}: a draft "
                                      "model's greedy tokens; verified in one forward "
                                      "(docs/speculative.md)",
           type=json_object, metavar="JSON", default_note="none: off"),
        _F(("--kv-events-config",), "vLLM's KV cache events for external routers (llm-d, "
                                    "Dynamo): {\"enable_kv_cache_events\": true, "
                                    "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                                    "\"tcp://*:5558\", \"topic\": …}; also publisher, "
                                    "buffer_steps, hwm, max_queue_size (docs/serving.md, KV "
                                    "cache events)",
           type=json_object, metavar="JSON", default_note="none: no events"),
        _F(("--optimization-level",), "accepted for vLLM's commands; no effect on eager CPU",
           type=int, metavar="N", default_note="none"),
    )),
    FlagGroup("Parallelism (docs/parallelism.md)", (
        _F(("--tensor-parallel-size", "-tp"), "ranks per replica, each a process with a "
                                              "slice of every layer", default=1, type=int,
           metavar="N"),
        _F(("--data-parallel-size", "-dp"), "replicas, each an engine with its own batch "
                                            "and KV cache", default=1, type=int, metavar="N"),
        _F(("--enable-expert-parallel",), "split the MoE experts over the ranks (with -dp > 1: "
                                          "over every rank of every replica)",
           action="store_true", default=False),
        _F(("--data-parallel-size-local", "-dpl"), "replicas on this node; the rest run on "
                                                   "--headless nodes", type=int, metavar="N",
           default_note="all"),
        _F(("--data-parallel-start-rank", "-dpr"), "first replica rank on this node (a "
                                                   "--headless node)", default=0, type=int,
           metavar="N"),
        _F(("--data-parallel-address", "-dpa"), "the head node's address (headless nodes "
                                                "connect to it)", default="127.0.0.1",
           metavar="HOST"),
        _F(("--data-parallel-rpc-port", "-dpp"), "the head's port for headless nodes",
           default=29550, type=int, metavar="PORT"),
        _F(("--headless",), "run only this node's replicas (no API server); they join the head",
           action="store_true", default=False),
        _F(("--distributed-executor-backend",), "mp: tensor-parallel ranks are processes on "
                                                "this node; ray: Ray actors placed on a running "
                                                "cluster (a TP group packed on a node), which "
                                                "also places the data-parallel replicas",
           default="mp", choices=("mp", "uni", "ray")),
        _F(("--data-parallel-backend", "-dpb"), "mp: replicas on this node and --headless "
                                                "nodes; ray: Ray places the replicas beyond "
                                                "this node's (spread over nodes)",
           default="mp", choices=("mp", "ray")),
        _F(("--ray-address",), "the Ray cluster to join (kvrelay never starts one)",
           metavar="HOST:PORT", default_note="$RAY_ADDRESS, else a cluster on this host"),
    )),
    FlagGroup("Disaggregation and Neuron settings (docs/deploy.md)", (
        _F(("--kv-transfer-config",), "vLLM's KV connector settings for disaggregated "
                                      "serving: kv_connector, kv_role (kv_producer, "
                                      "kv_consumer, kv_both), kv_connector_extra_config",
           type=json_object, metavar="JSON", default_note="none: no KV transfer"),
        _F(("--additional-config",), "the tutorial's {\"neuron_config\": {...}}: buckets, "
                                     "quantization, ep_degree …, each checked (docs/serving.md, "
                                     "Neuron-only knobs)",
           type=json_object, metavar="JSON", default_note="none"),
    )),
)


def serve_flag_dests() -> tuple[str, ...]:
    return tuple(flag.dest for group in SERVE_FLAGS for flag in group.flags)


# ---------------------------------------------------------------------------- the docs' block

def docs_block(text: str) -> str:
    """What is between the markers in `text`; ValueError when they are missing."""
    try:
        start = text.index(BEGIN) + len(BEGIN)
        end = text.index(END, start)
    except ValueError:
        raise ValueError(f"the markers {BEGIN} … {END} are missing") from None
    return text[start:end].strip("\n")


def with_docs_block(text: str, block: str) -> str:
    """`text` with the block between the markers replaced."""
    docs_block(text)
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.cli_flags",
                                     description="docs/serving.md's flag table from the table "
                                                 "--help is built from")
    parser.add_argument("--write", action="store_true", help="rewrite the block in the docs")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the file (default: %(default)s)")
    args = parser.parse_args(argv)
    text = args.docs.read_text()
    block = render_markdown(SERVE_FLAGS)
    if docs_block(text) == block:
        return 0
    if args.write:
        args.docs.write_text(with_docs_block(text, block))
        return 0
    print(f"{args.docs}: the flag table differs from kvrelay/cli_flags.py; run "  # noqa: T201
          "python -m kvrelay.cli_flags --write", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
