"""`kvrelay validate`: the tutorial's "Confirm your work" checks against a running deployment.

    kvrelay validate --base-url http://PREFILL_HOST:8000 --model openai/gpt-oss-120b --expect-di

Checks, in order (one line each: `PASS name: detail` or `FAIL name: detail`; exit 0 only
when every check passed):

    health       GET /health answers 200 (through a proxy: every prefill and decode server is up)
    models       GET /v1/models lists the model (or names the one to use when --model is absent)
    completion   the tutorial's request ("The capital of France is", max_tokens 16) at
                 temperature 0: OpenAI shape, non-empty choices[0].text, finish_reason
                 length|stop, usage populated, and a plausible answer (below)
    chat         a chat completion of the same shape at temperature 0 (content, or harmony
                 reasoning, non-empty), and a plausible answer
    traffic      --num-requests concurrent requests, mixed prompt and output lengths, completions
                 and chat, streamed (SSE to [DONE], usage chunk) and not: zero failures
    kv-transfer  (--expect-di) the decode servers pulled KV during this run, with no transfer
                 failures and no handshake errors (their /metrics; the servers come from
                 --decode-url/--prefill-url or from the proxy's /health listing)

A plausible answer: when validate knows the model's greedy answer to the prompt (the
embedded model, recognised by its name or by /v1/models' `root`, the checkpoint it loaded:
"Paris" to both default prompts), or `--expect WORD` names one, the text must contain that
word; otherwise it must look like language: not blank, at least 90 % printable characters,
and some letters (not only digits, punctuation or symbols, as "1.26269002482531" is).

The checks use plain httpx, no torch, so validate runs from any machine that reaches the URL.

Code: validate_checks.py (the checks), validate_answers.py (shapes and plausibility).
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvrelay import envs
from kvrelay.cli_flags import HelpFormatter
from kvrelay.deploy.validate_answers import TUTORIAL_PROMPT
from kvrelay.deploy.validate_checks import ValidateOptions, run_checks

PROG = "kvrelay validate"


# ---------------------------------------------------------------------------- the command

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG,
                description="The tutorial's 'Confirm your work' checks against a server or proxy.",
                formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, metavar="URL",
                   help="the proxy (DI) or the server, e.g. http://127.0.0.1:8000 (required)")
    p.add_argument("--model", default=None,
                   help="model name for requests (default: the first of /v1/models)")
    p.add_argument("--expect-di", action="store_true",
                   help="also check that decode servers pulled KV with no failures or handshake "
                        "errors")
    p.add_argument("--decode-url", action="append", default=[], metavar="URL",
                   help="a decode server whose /metrics to read (repeatable; default: the proxy's "
                        "listing)")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                   help="a prefill server whose /metrics to read (repeatable; default: the proxy's "
                        "listing)")
    p.add_argument("--num-requests", type=int, default=16, metavar="N",
                   help="concurrent requests of the traffic check")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds allowed for each request")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--prompt", default=TUTORIAL_PROMPT, help="the completion check's prompt")
    p.add_argument("--expect", default=None, metavar="WORD",
                   help="a word the completion check's answer must contain (default: the known "
                        "answer for the embedded model and the default prompt, else a "
                        "plausibility check)")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="max_tokens of the completion and chat checks")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvrelay validate [flags]`; exit 0 when every check passed, 1 otherwise, 2 for bad flags."""
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if args.expect is not None and not args.expect.strip():
        print(f"{PROG}: error: --expect needs a word", file=sys.stderr)
        return 2
    if args.num_requests < 0 or args.timeout <= 0 or args.max_tokens < 1:
        print(f"{PROG}: error: --num-requests must be ≥ 0, --timeout and --max-tokens positive",
              file=sys.stderr)
        return 2
    options = ValidateOptions(
        base_url=args.base_url, model=args.model, expect_di=args.expect_di,
        decode_urls=tuple(u.rstrip("/") for u in args.decode_url),
        prefill_urls=tuple(u.rstrip("/") for u in args.prefill_url), num_requests=args.num_requests,
        timeout=args.timeout, api_key=args.api_key or envs.OPENAI_API_KEY.raw(),
        prompt=args.prompt, max_tokens=args.max_tokens, expect=args.expect)
    results = run_checks(options)
    for r in results:
        print(r.line(), flush=True)
    ok = all(r.ok for r in results)
    print(f"{'PASS' if ok else 'FAIL'}: {sum(r.ok for r in results)}/{len(results)} checks passed "
          f"against {args.base_url}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
