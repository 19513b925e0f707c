"""`kvrelay plan`: recommend xPyD and --max-num-seqs for a workload (docs/proxy.md#kvrelay-plan).

    kvrelay plan --prefill-tok-s 9000 --decode-tok-s 400 --decode-batch 16 \\
        --rate 4 --prompt-len 1500 --output-len 200 --ttft-ms 1000 --itl-ms 50

Throughputs can come from `kvrelay bench serve --save-result` files instead
(--prefill-result, --decode-result), and the rate and lengths from --workload FILE.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvrelay.cli_flags import HelpFormatter
from kvrelay.plan.capacity import (
    Measured,
    PlanError,
    Workload,
    decode_from_result,
    neighbours,
    plan,
    prefill_from_result,
    workload_from_result,
)

PROG = "kvrelay plan"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


REQUIRED = """required inputs:
  --ttft-ms and --itl-ms                        the targets
  --prefill-tok-s, or --prefill-result FILE     one prefill server's throughput
  --decode-tok-s and --decode-batch, or --decode-result FILE
                                                one decode server's throughput and batch
  --rate, --prompt-len and --output-len, or --workload FILE
                                                the workload (flags given win over the file)
the rest are optional (defaults shown). The model: docs/proxy.md, section kvrelay plan."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Recommend prefill/decode server counts (xPyD) and "
                                       "--max-num-seqs from measured throughputs.",
                epilog=REQUIRED, formatter_class=HelpFormatter)
    m = p.add_argument_group("measured (one server each)")
    m.add_argument("--prefill-tok-s", type=float, metavar="TOK_S",
                   help="prompt tokens/s of one prefill server (required, or --prefill-result)")
    m.add_argument("--prefill-result", metavar="FILE",
                   help="bench result against one prefill server at --max-concurrency 1")
    m.add_argument("--decode-tok-s", type=float, metavar="TOK_S",
                   help="output tokens/s of one decode server (required, or --decode-result)")
    m.add_argument("--decode-batch", type=int, metavar="B",
                   help="the batch (concurrency) it was measured at (required, or "
                        "--decode-result)")
    m.add_argument("--itl-at-1-ms", type=float, default=None, metavar="MS",
                   help="ITL at batch 1 (a second point: step time interpolated linearly; "
                        "default: none, the step time stays flat up to --decode-batch)")
    m.add_argument("--decode-result", metavar="FILE",
                   help="bench result against one decode/single server at --max-concurrency B")
    w = p.add_argument_group("workload and targets")
    w.add_argument("--rate", type=float, metavar="R",
                   help="requests/s (required, or --workload)")
    w.add_argument("--prompt-len", type=float, metavar="TOKENS",
                   help="mean prompt tokens (required, or --workload)")
    w.add_argument("--output-len", type=float, metavar="TOKENS",
                   help="mean output tokens (required, or --workload)")
    w.add_argument("--workload", metavar="FILE",
                   help="bench result whose request rate and mean lengths to plan for")
    w.add_argument("--ttft-ms", type=float, required=True, metavar="MS",
                   help="mean TTFT target (required)")
    w.add_argument("--itl-ms", type=float, required=True, metavar="MS",
                   help="ITL target (required)")
    w.add_argument("--handoff-ms", type=float, default=0.0, metavar="MS",
                   help="KV transfer + proxy hop per request (kvrelay:kv_transfer_seconds)")
    w.add_argument("--max-util", type=float, default=0.8, metavar="U",
                   help="highest prefill utilisation allowed")
    w.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                   help="the prefill servers' --max-num-batched-tokens (their --max-num-seqs "
                        "is what fits in it)")
    return p


def _inputs(a: argparse.Namespace) -> tuple[Measured, Workload]:
    prefill = a.prefill_tok_s or (prefill_from_result(a.prefill_result) if a.prefill_result
                                  else None)
    decode, batch, itl1 = a.decode_tok_s, a.decode_batch, a.itl_at_1_ms
    if a.decode_result:
        d_tok, d_batch, _ = decode_from_result(a.decode_result)
        decode, batch = decode or d_tok, batch or d_batch
    rate, plen, olen = a.rate, a.prompt_len, a.output_len
    if a.workload:
        w_rate, w_plen, w_olen = workload_from_result(a.workload)
        rate, plen, olen = rate or w_rate, plen or w_plen, olen or w_olen
    missing = [flag for flag, v in (("--prefill-tok-s or --prefill-result", prefill),
                                    ("--decode-tok-s or --decode-result", decode),
                                    ("--decode-batch or --decode-result", batch),
                                    ("--rate or --workload", rate),
                                    ("--prompt-len or --workload", plen),
                                    ("--output-len or --workload", olen)) if v is None]
    if (missing or prefill is None or decode is None or batch is None or rate is None
            or plen is None or olen is None):
        raise PlanError(f"missing {', '.join(missing)}")
    return (Measured(prefill, decode, batch, itl1),
            Workload(rate, plen, olen, a.ttft_ms, a.itl_ms, a.handoff_ms, a.max_util,
                     a.max_num_batched_tokens))


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        measured, workload = _inputs(args)
        result = plan(measured, workload)
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(result.explain())
    for line in neighbours(measured, workload, result):
        print(f"neighbour {line}")
    print(f"prefill servers: {result.prefill} x `kvrelay serve ... --max-num-seqs "
          f"{result.prefill_max_num_seqs}`; decode servers: {result.decode} x `--max-num-seqs "
          f"{result.decode_max_num_seqs}`")
    print(f"kvrelay deploy --prefill {result.prefill} --decode {result.decode} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
