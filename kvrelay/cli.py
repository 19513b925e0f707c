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
import json
import logging
import os
import resource
import sys
import time
from typing import NoReturn

DTYPES = ("auto", "bfloat16", "float16", "float32")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="gpt-oss checkpoint directory or HF repo id (default: the embedded model)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON")
    p.add_argument("--download-dir", default=None)
    p.add_argument("--quantization", choices=("auto", "mxfp4", "none"), default="auto",
                   help="expert weights: keep MXFP4 packed (auto/mxfp4) or dequantise (none)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors naming the flag (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or HF repo id (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="replicas on this node (default: all); the rest run on --headless nodes")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="first replica rank on this node (a --headless node)")
    p.add_argument("--data-parallel-address", "-dpa", default="127.0.0.1",
                   help="the head node's address (headless nodes connect to it)")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=29550,
                   help="the head's port for headless nodes")
    p.add_argument("--headless", action="store_true",
                   help="run only this node's replicas (no API server); they join the head")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction,
                   default=False)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON")
    p.add_argument("--additional-config", type=_json_object, default=None, metavar="JSON")
    p.add_argument("--kv-transfer-config", type=_json_object, default=None, metavar="JSON")
    p.add_argument("--optimization-level", type=int, default=None)
    p.add_argument("--download-dir", default=None)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--quantization", choices=("mxfp4",), default=None)
    p.add_argument("--async-scheduling", action="store_true",
                   help="plan the next step while the current one computes")
    # function calling and reasoning, with vLLM's names (kvrelay/server/tools.py)
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide to call tools (tool_choice 'auto' on chat)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how tool calls are read from the output: 'openai' (gpt-oss harmony)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="'openai_gptoss': reasoning from harmony's analysis channel "
                        "(harmony checkpoints always split it)")
    p.add_argument("--logits-processors", nargs="+", default=[], metavar="MODULE:ATTR",
                   help="factories f(params, prompt_ids) -> logits processor, "
                        "applied to every request")
    # the HTTP side's bounds and trust (kvrelay/server/admission.py, docs/serving.md)
    p.add_argument("--max-queued-requests", type=int, default=1024, metavar="N",
                   help="sequences that may wait beyond --max-num-seqs; past it 503 + Retry-After")
    p.add_argument("--max-seqs-per-request", type=int, default=256, metavar="N",
                   help="prompts x n of one request; past it 400")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="comma-separated proxy addresses (or '*') whose X-Forwarded-For/-Proto "
                        "are trusted (default: none)")


SERVE_ENGINE_FLAGS = (
    "model", "served_model_name", "tensor_parallel_size", "data_parallel_size",
    "enable_expert_parallel", "data_parallel_size_local", "data_parallel_start_rank",
    "data_parallel_address", "data_parallel_rpc_port", "headless",
    "enable_prefix_caching", "disable_hybrid_kv_cache_manager", "max_model_len",
    "max_num_batched_tokens", "max_num_seqs", "block_size", "dtype", "max_logprobs", "seed",
    "hf_overrides", "additional_config",
    "kv_transfer_config", "optimization_level", "download_dir", "device", "kv_cache_memory_bytes",
    "num_gpu_blocks_override", "quantization", "logits_processors", "async_scheduling")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvrelay", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("proxy", help="disaggregated-serving proxy (kvrelay proxy --help)")
    sub.add_parser("bench", help="serving benchmark (kvrelay bench serve --help)")
    sub.add_parser("deploy", help="stand up a topology on this machine (kvrelay deploy --help)")
    sub.add_parser("validate",
                   help="the tutorial's 'Confirm your work' checks (kvrelay validate --help)")
    sub.add_parser("plan",
                   help="recommend xPyD and --max-num-seqs from measurements (kvrelay plan --help)")
    serve = sub.add_parser("serve", help="OpenAI-compatible server (vLLM's flags)")
    _add_serve_flags(serve)
    gen = sub.add_parser("generate", help="greedy generation with the model (no server)")
    gen.add_argument("prompt", nargs="?", default="The capital of France is")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-model-len", type=int, default=4096)
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
    from kvrelay.engine.llm import LLM
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


def _serve(args: argparse.Namespace) -> int:
    if not args.headless:                   # a taken port: one line now, not after the model loads
        from kvrelay.ports import check_serve_ports
        check_serve_ports(args)
    from kvrelay.config import EngineArgs, EngineConfig
    from kvrelay.server.launch import serve
    engine_args = EngineArgs(**{name: getattr(args, name) for name in SERVE_ENGINE_FLAGS})
    agent = agent_options(args)                                           # flag errors first
    http = http_options(args)
    # every engine value checked before a process starts
    config = EngineConfig.from_args(engine_args)
    if engine_args.headless:
        from kvrelay.engine.dp_remote import run_headless
        return run_headless(config.args)
    return serve(config, args.host, args.port, args.api_key, agent, http)


def http_options(args: argparse.Namespace):
    """The HTTP side's flags (ValueError names the flag)."""
    from kvrelay.server.admission import AdmissionLimits
    from kvrelay.server.launch import HTTPOptions
    AdmissionLimits(1, args.max_queued_requests, args.max_seqs_per_request)     # checks them
    return HTTPOptions(args.max_queued_requests, args.max_seqs_per_request,
                       args.forwarded_allow_ips)


def agent_options(args: argparse.Namespace):
    """The tool-calling flags and the Responses store size (ValueError names the flag)."""
    from kvrelay import envs
    from kvrelay.server.tools import AgentOptions
    store = envs.RESPONSES_STORE.raw() not in ("0", "false", "False")
    return AgentOptions(enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        responses_store_size=(envs.RESPONSES_STORE_MAX_ENTRIES.as_int() or 0
                                              if store else 0))


if __name__ == "__main__":
    sys.exit(main())
