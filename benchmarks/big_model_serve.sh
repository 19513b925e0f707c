#!/usr/bin/env bash
# Served decode on a big checkpoint: llama.cpp (its MXFP4-expert GGUF of the same weights)
# then kvrelay, one after the other (both do not fit in memory at once), each driven by
# `kvrelay bench serve` at concurrency 4 (4 requests) and 1 (8 requests, one after another):
# random prompts of INPUT_LEN tokens (8), 32 output tokens, greedy, ignore_eos, after one
# unmeasured warm-up pass at concurrency 4 (a fresh server first faults its weights in).
# Records `uptime` around every measurement.
#
#   [ORDER=kvrelay-first] [INPUT_LEN=8] [C1_PROMPTS=8] \
#       benchmarks/big_model_serve.sh CKPT GGUF OUT_DIR [LLAMA_SERVER]
set -euo pipefail
CKPT=${1:?CKPT}; GGUF=${2:?GGUF}; OUT=${3:?OUT_DIR}
# llama-server: the 4th argument, else build_llamacpp.sh's build under $KVRELAY_PEERS_DIR
# (default: peers/ beside this checkout; see benchmarks/README.md, "Peers")
PEERS=${KVRELAY_PEERS_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/peers}
LLAMA=${4:-$PEERS/llamacpp/build/bin/llama-server}
if [ -f "$GGUF" ] && [ ! -x "$LLAMA" ]; then  # without llama-server only kvrelay runs
  echo "warning: llama-server not found at $LLAMA (build it with build_llamacpp.sh" \
    "\$KVRELAY_PEERS_DIR/llamacpp, set KVRELAY_PEERS_DIR or pass LLAMA_SERVER): kvrelay only" >&2
fi
PORT=${PORT:-18931}   # must be free: a server already on it would be measured instead
mkdir -p "$OUT"
PID=
if curl -s -o /dev/null "http://127.0.0.1:$PORT/"; then echo "port $PORT is in use" >&2; exit 1; fi

stop() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=; }

peak_rss() {  # NAME: VmHWM of the server and its children (kvrelay's engine runs in a child)
  for p in "$PID" $(pgrep -P "$PID"); do
    echo "$1 pid $p $(grep VmHWM /proc/"$p"/status)" | tee -a "$OUT/uptime.txt"
  done
}
trap stop EXIT

wait_up() {  # until a 1-token completion succeeds (the API answers 503 while the model loads)
  for _ in $(seq 1 900); do
    curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": "hi", "max_tokens": 1}' >/dev/null && return 0
    kill -0 "$PID" 2>/dev/null || { echo "server died" >&2; return 1; }
    sleep 1
  done
  return 1
}

# Requests per concurrency-1 run, one after another: a single 32-token request gave TPOTs
# 81-124 ms for the same server across rounds (session 7), too few tokens to compare; the
# machine's bandwidth also changes for seconds at a time (session 8), so 8 requests.
C1_PROMPTS=${C1_PROMPTS:-8}
# Prompt tokens per request (8: decode-dominated; longer prompts measure TTFT too).
INPUT_LEN=${INPUT_LEN:-8}
# Context room for 4 concurrent requests of INPUT_LEN + 32 tokens (and the warm-up's):
# kvrelay's --max-model-len per request, llama.cpp's -c shared by its 4 slots (--kv-unified).
MAX_LEN=$(( INPUT_LEN + 64 > 256 ? INPUT_LEN + 64 : 256 ))
LLAMA_CTX=$(( 8 * MAX_LEN > 1024 ? 8 * MAX_LEN : 1024 ))   # twice the room: llama.cpp re-tokenizes the prompt text
KV_BYTES=$(( (4 * MAX_LEN * 49152 > (64 << 20) ? 4 * MAX_LEN * 49152 : (64 << 20)) ))

# Each pass draws its own prompts (its own seed): a pass that repeated the warm-up's prompts
# would measure prefix-cache hits (both servers reuse a matching prompt) instead of prefill.
SEED=0
bench() {  # NAME CONCURRENCY
  local prompts=$2
  [ "$2" = 1 ] && prompts=$C1_PROMPTS
  SEED=$((SEED + 1))
  echo "$1 c=$2 start: $(uptime)" | tee -a "$OUT/uptime.txt"
  kvrelay bench serve --port "$PORT" --tokenizer "$CKPT" --dataset-name random \
    --random-input-len "$INPUT_LEN" --random-output-len 32 --num-prompts "$prompts" --seed "$SEED" \
    --max-concurrency "$2" --ignore-eos --temperature 0 --disable-tqdm --no-plot \
    --save-result --result-dir "$OUT" --result-filename "$1-c$2.json" > "$OUT/$1-c$2.txt" \
    || echo "$1 c=$2: bench failed" >&2
  echo "$1 c=$2 end: $(uptime)" | tee -a "$OUT/uptime.txt"
}

run_llamacpp() {
  [ -x "$LLAMA" ] && [ -f "$GGUF" ] || return 0
  T0=$(date +%s)
  "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -np 4 -c "$LLAMA_CTX" --kv-unified -t 2 \
    --no-webui -a gpt-oss-20b-shaped > "$OUT/llama-server.log" 2>&1 &
  PID=$!
  wait_up && echo "llama.cpp up in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/uptime.txt"
  bench llamacpp-warmup 4; bench llamacpp 1; bench llamacpp 4
  peak_rss llamacpp; stop
}

run_kvrelay() {
  T0=$(date +%s)
  kvrelay serve "$CKPT" --host 127.0.0.1 --port "$PORT" --max-model-len "$MAX_LEN" \
    --kv-cache-memory-bytes "$KV_BYTES" --served-model-name gpt-oss-20b-shaped \
    > "$OUT/kvrelay-serve.log" 2>&1 &
  PID=$!
  wait_up && echo "kvrelay up in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/uptime.txt"
  bench kvrelay-warmup 4; bench kvrelay 1; bench kvrelay 4
  peak_rss kvrelay; stop
}

# ORDER=kvrelay-first runs kvrelay first: rounds can alternate, so neither server always
# starts right after the other one's exit (page cache and memory reclaim differ).
if [ "${ORDER:-llamacpp-first}" = kvrelay-first ]; then run_kvrelay; run_llamacpp
else run_llamacpp; run_kvrelay; fi
