"""The `kvrelay` command. Thin: parses flags and hands over to the package.

    kvrelay generate [PROMPT] [--model DIR] [--max-tokens N] [--dtype ...]
        greedy generation on the embedded default model (or a gpt-oss checkpoint);
        the stand-in main job until `kvrelay serve` lands.
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time

DTYPES = ("auto", "bfloat16", "float16", "float32")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="gpt-oss checkpoint directory or HF repo id (default: the embedded model)")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation with the model (no server)")
    gen.add_argument("prompt", nargs="?", default="The capital of France is")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_model_flags(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvrelay {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 2


def _generate(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.model.generate import PagedGreedyLoop
    from kvrelay.model.loader import load_model
    from kvrelay.model.tokenizer import load_tokenizer

    model_dir = _resolve(args.model, args.download_dir)
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    quant = None if args.quantization == "none" else args.quantization
    t0 = time.perf_counter()
    loaded = load_model(model_dir, dtype=dtype, quantization=quant, hf_overrides=args.hf_overrides)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"model: {model_dir} ({loaded.weight_bytes / 2**20:.0f} MiB of weights, "
          f"peak RSS {rss:.0f} MiB, loaded in {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    tok = load_tokenizer(model_dir)
    prompt_ids = tok.encode_chat(args.prompt) if args.chat else tok.encode(args.prompt)
    loop = PagedGreedyLoop(loaded.model, num_blocks=-(-(len(prompt_ids) + args.max_tokens) // 16) + 1,
                           block_size=16)
    t0 = time.perf_counter()
    out = loop.generate(prompt_ids, args.max_tokens, stop_ids=tok.eos_token_ids)
    elapsed = time.perf_counter() - t0
    print(f"{args.prompt}{tok.decode(out)}")
    print(f"({len(out)} tokens in {elapsed:.2f}s)", file=sys.stderr)
    return 0


def _resolve(model: str | None, download_dir: str | None):
    if model is None:
        from kvrelay.model.embedded import embedded_model_dir
        return embedded_model_dir()
    from kvrelay.model.loader import resolve_model_path
    return resolve_model_path(model, download_dir)


if __name__ == "__main__":
    sys.exit(main())
