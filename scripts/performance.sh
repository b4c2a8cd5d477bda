#!/usr/bin/env bash
# Reproduce docs/performance.md: radixserve (served, streaming) vs transformers' static batches,
# the shared-prefix workload with the radix cache on and off, and one-batch prefill/decode.
# Usage: scripts/performance.sh [OUT_DIR]   (takes ~20 minutes on a 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-/tmp/radixserve-perf}
mkdir -p "$OUT"
PORT=${PORT:-30123}

serve() {  # serve DTYPE EXTRA...; waits until healthy
  local dtype=$1; shift
  $PY -m radixserve serve --port "$PORT" --dtype "$dtype" --max-total-tokens 80000 \
    --log-level warning "$@" > "$OUT/server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    sleep 0.5
  done
  echo "server did not start" >&2; kill $SERVER; exit 1
}
stop() { kill -TERM "$SERVER"; wait "$SERVER" || true; }

bench() {  # bench TAG ARGS...
  local tag=$1; shift
  $PY -m radixserve bench serving --backend radixserve --port "$PORT" --disable-tqdm \
    --tag "$tag" --output-file "$OUT/serving.jsonl" "$@"
}

for dtype in bfloat16 float32; do
  serve "$dtype"
  for c in 1 8 32 64; do
    n=$(( c < 8 ? 4 : (c < 64 ? 2 * c : c) ))
    bench "radixserve-$dtype-c$c" --flush-cache --dataset-name random --random-input-len 256 \
      --random-output-len 128 --num-prompts "$n" --max-concurrency "$c"
  done
  stop
  for c in 1 8 32 64; do
    n=$(( c < 8 ? 4 : (c < 64 ? 2 * c : c) ))
    $PY -m radixserve bench hf-baseline --dtype "$dtype" --batch-size "$c" --num-prompts "$n" \
      --random-input-len 256 --random-output-len 128 --output-file "$OUT/hf.jsonl"
  done
done

for radix in on off; do
  extra=()
  [ "$radix" = off ] && extra=(--disable-radix-cache)
  serve bfloat16 --schedule-policy lpm "${extra[@]}"
  bench "shared-prefix-radix-$radix" --dataset-name generated-shared-prefix \
    --gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 \
    --gsp-question-len 64 --gsp-output-len 64 --flush-cache
  stop
done

for dtype in bfloat16 float32; do
  $PY -m radixserve bench one-batch --dtype "$dtype" --batch-size 1 --input-len 1024 \
    --output-len 16 --output-file "$OUT/one_batch.jsonl" --log-level warning
  $PY -m radixserve bench one-batch --dtype "$dtype" --batch-size 1 32 --input-len 256 \
    --output-len 32 --output-file "$OUT/one_batch.jsonl" --log-level warning
done
echo "results in $OUT"
