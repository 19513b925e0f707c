#!/usr/bin/env bash
# Prefix-caching benchmark (the tutorial's step 7): the same workloads against `kvrelay serve`
# with --enable-prefix-caching and with --no-enable-prefix-caching; prints TTFT p50 and output
# throughput for each, and the ratio on / off.
#
#   benchmarks/prefix_caching.sh [MODEL_DIR]        # default: the embedded model
#
# Workloads (kvrelay bench serve):
#   1. prefix_repetition: 4 shared prefixes of 460 tokens + a unique 52-token suffix per prompt
#      (90 % of every prompt is shared), 32 prompts, 8 output tokens, 4 in flight.
#   2. sharegpt multi-turn: conversations sent turn by turn with the growing history as the
#      prompt, 24 requests, 8 output tokens, 4 in flight.
# Environment: PORT (8000; the server without caching listens on PORT_OFF, default PORT+1),
#   OUT (benchmarks/results/prefix_caching), KVRELAY (kvrelay),
#   SERVE_FLAGS (extra serve flags, default "--dtype float32"), NUM_PROMPTS (32),
#   CONCURRENCY (4), OUTPUT_LEN (8), MULTI_TURN_PROMPTS (24; 0 skips the workload).
# On a machine shared with other jobs set OMP_NUM_THREADS=1: OpenMP threads spinning at
# barriers on oversubscribed cores make every step many times slower.
set -euo pipefail

MODEL="${1:-}"
PORT="${PORT:-8000}"
HOST=127.0.0.1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/benchmarks/results/prefix_caching}"
KVRELAY="${KVRELAY:-kvrelay}"
SERVE_FLAGS="${SERVE_FLAGS:---dtype float32}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
CONCURRENCY="${CONCURRENCY:-4}"
OUTPUT_LEN="${OUTPUT_LEN:-8}"
MULTI_TURN_PROMPTS="${MULTI_TURN_PROMPTS:-24}"
mkdir -p "$OUT"

# The tokenizer for exact prompt lengths: the model's own (the embedded model's cache dir).
if [[ -n "$MODEL" ]]; then
  TOKENIZER="$MODEL"
else
  TOKENIZER="$(python -c 'from kvrelay.model.embedded import embedded_model_dir; print(embedded_model_dir())')"
fi

# Both servers run at once (an idle one takes no CPU) and the runs alternate on, off, on, off:
# on a shared machine the load drifts, and adjacent runs see the same drift.
PIDS=()
stop_servers() {
  for pid in "${PIDS[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap stop_servers EXIT INT TERM

start_server() {   # $1: on | off, $2: port
  local flag=--enable-prefix-caching
  [[ "$1" == off ]] && flag=--no-enable-prefix-caching
  # shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
  setsid $KVRELAY serve $MODEL --host "$HOST" --port "$2" --served-model-name bench \
      --max-model-len 2048 $flag $SERVE_FLAGS > "$OUT/serve_$1.log" 2>&1 &
  PIDS+=($!)
}

wait_ready() {     # $1: on | off, $2: port
  for _ in $(seq 900); do
    if curl -sf "http://$HOST:$2/health" > /dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "server ($1) not ready after 900 s; see $OUT/serve_$1.log" >&2
  exit 1
}

bench() {          # $1: on | off, $2: result name, then flags
  local port=$PORT_ON name=$2
  [[ "$1" == off ]] && port=$PORT_OFF
  shift 2
  $KVRELAY bench serve --base-url "http://$HOST:$port" --model bench --tokenizer "$TOKENIZER" --seed 0 \
      --ignore-eos --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$name.json" "$@" \
      > "$OUT/$name.txt"
  echo "--- $name"
  grep -E "Successful|Failed|Median TTFT|Output token throughput|hit rate" "$OUT/$name.txt"
}

PORT_ON=$PORT
PORT_OFF="${PORT_OFF:-$((PORT + 1))}"
start_server on "$PORT_ON"
start_server off "$PORT_OFF"
wait_ready on "$PORT_ON"
wait_ready off "$PORT_OFF"
for port in "$PORT_ON" "$PORT_OFF"; do   # warm-up: first-request costs out of the measurement
  $KVRELAY bench serve --base-url "http://$HOST:$port" --model bench --dataset-name random \
      --random-input-len 16 --random-output-len 2 --num-prompts 2 --disable-tqdm > /dev/null
done

for mode in on off; do
  bench "$mode" "prefix_repetition_$mode" --dataset-name prefix_repetition \
      --prefix-repetition-prefix-len 460 --prefix-repetition-suffix-len 52 \
      --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len "$OUTPUT_LEN" \
      --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY"
done
if [[ "$MULTI_TURN_PROMPTS" -gt 0 ]]; then
  for mode in on off; do
    bench "$mode" "sharegpt_multi_turn_$mode" --dataset-name sharegpt --sharegpt-multi-turn \
        --sharegpt-output-len "$OUTPUT_LEN" --sharegpt-max-total-len 1536 --sharegpt-max-prompt-len 1536 \
        --num-prompts "$MULTI_TURN_PROMPTS" --max-concurrency "$CONCURRENCY"
  done
fi
stop_servers

python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"\n{'workload':<22}{'caching':>8}{'TTFT p50 ms':>13}{'out tok/s':>11}{'hit rate':>10}")
for work in ("prefix_repetition", "sharegpt_multi_turn"):
    runs = {m: out / f"{work}_{m}.json" for m in ("on", "off")}
    if not all(p.exists() for p in runs.values()):
        continue
    d = {m: json.loads(p.read_text()) for m, p in runs.items()}
    for m in ("on", "off"):
        rate = d[m].get("prefix_cache_hit_rate")
        print(f"{work:<22}{m:>8}{d[m]['median_ttft_ms']:>13.1f}{d[m]['output_throughput']:>11.2f}"
              f"{'n/a' if rate is None else f'{100 * rate:.1f} %':>10}")
    print(f"{work:<22}{'on/off':>8}{d['off']['median_ttft_ms'] / d['on']['median_ttft_ms']:>12.2f}x"
          f"{d['on']['output_throughput'] / d['off']['output_throughput']:>10.2f}x   (TTFT: off/on)")
PY
