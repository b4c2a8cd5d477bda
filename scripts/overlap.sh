#!/usr/bin/env bash
# The overlap section of docs/performance.md: `bench serving` at concurrency 1, 8, 32 and 64
# against two servers started side by side, one per scheduler loop (overlap, the default, and
# --disable-overlap-schedule). The runs alternate overlap/normal then normal/overlap for
# ROUNDS rounds, so a shared machine's drift falls on both loops alike; then the per-token
# cost at batch 1 (`bench overhead`). Usage: scripts/overlap.sh [OUT_DIR]  (~25 min, 2 cores)
# Where the CPUs do not allow overlapping (scheduler.cpus_for_overlap: fewer than two CPUs per
# model thread, e.g. 2 cores), the default server runs the normal loop too; docs/performance.md
# has the numbers of commit 128e0a1, which overlapped regardless.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-/tmp/radixserve-overlap}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
PORTS=(30131 30132)
LOOPS=(overlap normal)
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

start_server "$OUT/server-overlap.log" "${PORTS[0]}"
start_server "$OUT/server-normal.log" "${PORTS[1]}" --disable-overlap-schedule
wait_healthy "${PORTS[@]}"

bench() {  # bench LOOP_INDEX CONCURRENCY ROUND
  local i=$1 c=$2 r=$3 n
  n=$(( c == 1 ? 3 : (c == 8 ? 16 : c) ))
  $PY -m radixserve bench serving --backend radixserve --port "${PORTS[$i]}" --disable-tqdm \
    --flush-cache --dataset-name random --random-input-len 128 --random-output-len 64 \
    --random-range-ratio 1.0 --num-prompts "$n" --max-concurrency "$c" \
    --tag "${LOOPS[$i]}-c$c-r$r" --output-file "$OUT/serving.jsonl" > /dev/null
}

for r in $(seq 1 "$ROUNDS"); do
  for c in 1 8 32 64; do
    if (( r % 2 )); then order=(0 1); else order=(1 0); fi
    for i in "${order[@]}"; do bench "$i" "$c" "$r"; done
    echo "round $r, concurrency $c done"
  done
done
stop_servers
PIDS=()

$PY scripts/serving_table.py "$OUT/serving.jsonl"

$PY -m radixserve bench overhead --max-total-tokens 4000 --output-file "$OUT/overhead.jsonl" \
  --log-level warning
