"""The `kvrelay` command. Thin: parses flags and hands over to the package.

    kvrelay serve [MODEL] [vLLM's serve flags]
        the OpenAI-compatible server (single instance, TP/DP, or a DI prefill/decode role)
    kvrelay proxy --prefiller-host H --prefiller-port P... --decoder-host H --decoder-port P...
        the disaggregated-serving proxy
    kvrelay plan --prefill-tok-s N --decode-tok-s N --decode-batch B --rate R ...
        recommend xPyD and --max-num-seqs from measured throughputs (docs/proxy.md)
    kvrelay generate [PROMPT] [--model DIR] [--max-tokens N] [--dtype ...]
        greedy generation through the engine (`LLM.generate`), no server
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kvrelay.cli_flags import (
    DTYPES,
    QUANTIZATIONS,
    SERVE_FLAGS,
    HelpFormatter,
    add_flags,
    json_object,
)

if TYPE_CHECKING:
    from kvrelay.config import EngineArgs
    from kvrelay.server.options import HTTPOptions
    from kvrelay.server.tools import AgentOptions


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="gpt-oss checkpoint directory or HF repo id (default: the embedded model)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations; auto: the checkpoint's torch_dtype")
    p.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                   help="keys merged into config.json before the model is built")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache --model is looked up in (default: "
                        "$HF_HUB_CACHE, else ~/.cache/huggingface/hub)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="expert weights: keep MXFP4 packed (auto/mxfp4) or dequantise (none)")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors naming the flag (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's serve flags, from the one table docs/serving.md is rendered from."""
    add_flags(p, SERVE_FLAGS)


SERVE_ENGINE_FLAGS = (
    "model", "served_model_name", "tensor_parallel_size", "data_parallel_size",
    "enable_expert_parallel", "data_parallel_size_local", "data_parallel_start_rank",
    "data_parallel_address", "data_parallel_rpc_port", "headless",
    "enable_prefix_caching", "disable_hybrid_kv_cache_manager", "max_model_len",
    "max_num_batched_tokens", "max_num_seqs", "block_size", "dtype", "max_logprobs", "seed",
    "hf_overrides", "additional_config",
    "kv_transfer_config", "optimization_level", "download_dir", "device", "kv_cache_memory_bytes",
    "num_gpu_blocks_override", "quantization", "logits_processors", "async_scheduling",
    "kv_events_config", "distributed_executor_backend", "data_parallel_backend", "ray_address",
    "speculative_config")
SERVE_EPILOG = ("Every flag with its default and meaning: docs/serving.md, section Flags.\n"
                "The names and meanings are vLLM's.")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvrelay", description=__doc__.split("\n")[0],
                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                title="commands", metavar="COMMAND",
                                help="kvrelay COMMAND --help: its flags")
    for name, summary in (
            ("proxy", "disaggregated-serving proxy (kvrelay proxy --help)"),
            ("bench", "serving benchmark (kvrelay bench serve --help)"),
            ("deploy", "stand up a topology on this machine (kvrelay deploy --help)"),
            ("validate", "the tutorial's 'Confirm your work' checks (kvrelay validate --help)"),
            ("plan", "recommend xPyD and --max-num-seqs from measurements (kvrelay plan --help)")):
        sub.add_parser(name, help=summary, formatter_class=HelpFormatter)
    serve = sub.add_parser("serve", help="OpenAI-compatible server (vLLM's flags)",
                           description="The OpenAI-compatible server (vLLM's flags).",
                           epilog=SERVE_EPILOG, formatter_class=HelpFormatter)
    _add_serve_flags(serve)
    gen = sub.add_parser("generate", help="greedy generation with the model (no server)",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompt", nargs="?", default="The capital of France is",
                     help="the text to complete (with --chat: the user message)")
    gen.add_argument("--max-tokens", type=int, default=16, metavar="N",
                     help="tokens to generate at most")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-model-len", type=int, default=4096, metavar="N",
                     help="longest prompt + output, in tokens")
    _add_model_flags(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:  # the proxy parses its own flags (and needs no torch)
        from kvrelay.proxy.main import main as proxy_main
        return proxy_main(argv[1:])
    if argv[:1] == ["bench"]:  # these parse their own flags and need no torch either
        from kvrelay.bench.main import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["deploy"]:
        from kvrelay.deploy.main import main as deploy_main
        return deploy_main(argv[1:])
    if argv[:1] == ["plan"]:                    # arithmetic only: no torch
        from kvrelay.plan.main import main as plan_main
        return plan_main(argv[1:])
    if argv[:1] == ["validate"]:
        from kvrelay.deploy.validate import main as validate_main
        return validate_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            # A server's engine shares the cores with its API process (and, here, often with
            # other servers): OpenMP threads that spin ~300k rounds at every barrier (libgomp's
            # default) burn the CPU the others need — under load 6.3 vs 1.1 ms of engine CPU
            # per token at 64 streams; fully passive threads pay a wake-up per op instead.
            # A short spin keeps both (docs/serving.md). The user's own settings win.
            if "OMP_WAIT_POLICY" not in os.environ:
                os.environ.setdefault("GOMP_SPINCOUNT", "20000")
            return _serve(args)
    except (ValueError, RuntimeError, OSError, TypeError) as e:
        print(f"kvrelay {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 2


def _generate(args: argparse.Namespace) -> int:
    from kvrelay.llm import LLM
    from kvrelay.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, hf_overrides=args.hf_overrides,
              download_dir=args.download_dir, max_model_len=args.max_model_len,
              quantization=args.quantization)
    engine = llm.engine
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"model: {engine.model_dir} ({engine.model.weight_bytes() / 2**20:.0f} MiB of weights, "
          f"peak RSS {rss:.0f} MiB, ready in {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    prompt: str | list[int] = args.prompt
    if args.chat:
        if engine.tokenizer is None:         # a one-line error, not an AttributeError traceback
            raise ValueError(f"--chat needs a tokenizer.json in {engine.model_dir}")
        prompt = engine.tokenizer.encode_chat(args.prompt)
    t0 = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
    completion = out.outputs[0]
    print(f"{args.prompt}{completion.text}" if not args.chat else completion.text)
    print(f"({len(completion.token_ids)} tokens in {time.perf_counter() - t0:.2f}s, "
          f"finish_reason={completion.finish_reason})", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class ServeConfig:
    """`kvrelay serve`'s flags, typed: made once, by `_serve`, from the command line, and
    all that `_launch` starts from. Each part checks its own flags as it is made
    (ValueError naming the flag); this checks that MODEL is a checkpoint (a directory, or a
    repo id in the HF cache, with a valid config.json). All of it before torch, the server
    or a port: a bad flag or path is one line within a second."""

    engine: EngineArgs          # the engine's flags (their JSON ones checked: engine_args)
    agent: AgentOptions         # tool calling, reasoning, the Responses store, MCP servers
    http: HTTPOptions           # where the API listens, its key, the admission bounds

    def __post_init__(self) -> None:
        if self.engine.model is not None:   # the embedded model is built later, on first use
            from kvrelay.model.config import load_config
            from kvrelay.model.locate import locate_checkpoint
            load_config(locate_checkpoint(self.engine.model, self.engine.download_dir),
                        self.engine.hf_overrides)


def _serve(args: argparse.Namespace) -> int:
    """The flags become one ServeConfig here, and only here; then `_launch` runs it."""
    from kvrelay.server.options import HTTPOptions
    config = ServeConfig(engine=engine_args(args), agent=agent_options(args),
                         http=HTTPOptions(host=args.host, port=args.port, api_key=args.api_key,
                                          max_queued_requests=args.max_queued_requests,
                                          max_seqs_per_request=args.max_seqs_per_request,
                                          forwarded_allow_ips=args.forwarded_allow_ips))
    return _launch(config)


def _launch(config: ServeConfig) -> int:
    """The API server with its replicas (here, on headless nodes, or placed by Ray), else
    (--headless) this node's data-parallel replicas for a head; the exit code. Each is one
    call into the module that owns it, with every engine value resolved before."""
    args, http = config.engine, config.http
    if not args.headless:
        _check_server_can_start(args, http)
    from kvrelay.config import EngineConfig
    engine = EngineConfig.from_args(args)       # every engine value, before a process starts
    if not args.headless:
        from kvrelay.server.launch import serve
        return serve(engine, http, config.agent)
    from kvrelay.engine.dp_headless import run_headless
    return run_headless(engine.args)


def _check_server_can_start(args: EngineArgs, http: HTTPOptions) -> None:
    """What the API server needs of this machine, asked before anything slow starts: its
    ports free (OSError) and, where Ray places ranks or replicas, a cluster to join
    (ConnectionError). One line now, not an error after the model loads."""
    from kvrelay.ports import check_serve_ports
    check_serve_ports(http.host, http.port, args)
    if args.ray_replicas:
        from kvrelay.distributed.ray_cluster import connect
        connect(args.ray_address)


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine's flags, with what EngineConfig will parse of them checked now, without
    torch: `--additional-config` (and `--quantization none` against its neuron_config),
    `--kv-transfer-config`, `--kv-events-config` (ValueError names the flag)."""
    from kvrelay.config import EngineArgs, NeuronConfig
    from kvrelay.disagg.params import KVTransferConfig
    from kvrelay.kv_events.config import KVEventsConfig
    engine = EngineArgs(**{name: getattr(args, name) for name in SERVE_ENGINE_FLAGS})
    neuron = NeuronConfig.from_additional_config(engine.additional_config)
    if engine.quantization == "none" and neuron.quantization is not None:
        raise ValueError(f"--quantization none contradicts --additional-config's "
                         f"neuron_config.quantization {neuron.quantization!r}")
    KVTransferConfig.from_json(engine.kv_transfer_config)
    KVEventsConfig.from_json(engine.kv_events_config)
    return engine


def agent_options(args: argparse.Namespace) -> AgentOptions:
    """The tool-calling flags and the Responses store size (ValueError names the flag)."""
    from kvrelay import envs
    from kvrelay.server.options import parse_tool_servers
    from kvrelay.server.tools import AgentOptions
    store = envs.RESPONSES_STORE.raw() not in ("0", "false", "False")
    return AgentOptions(enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        responses_store_size=(envs.RESPONSES_STORE_MAX_ENTRIES.as_int() or 0
                                              if store else 0),
                        responses_store_max_bytes=envs.RESPONSES_STORE_MAX_BYTES.as_int() or 0,
                        responses_store_max_entry_bytes=(
                            envs.RESPONSES_STORE_MAX_ENTRY_BYTES.as_int() or 0),
                        responses_owner_header=args.responses_owner_header,
                        responses_store_path=responses_store_path(args),
                        tool_servers=parse_tool_servers(args.tool_server),
                        tool_server_timeout_s=args.tool_server_timeout,
                        tool_server_max_calls=args.tool_server_max_calls,
                        tool_server_max_output_bytes=(
                            args.tool_server_max_output_bytes
                            or envs.TOOL_SERVER_MAX_OUTPUT_BYTES.as_int() or 0))


def responses_store_path(args: argparse.Namespace) -> str | None:
    """The SQLite file of the responses store (None: in memory): one per port under the
    state directory, so the servers of one host (kvrelay deploy) each keep their own."""
    from kvrelay import envs
    if args.responses_store == "memory":
        return None
    state = Path(args.state_dir).expanduser() if args.state_dir else envs.state_dir()
    return str(state / f"responses-{args.port}.sqlite3")


if __name__ == "__main__":
    sys.exit(main())
