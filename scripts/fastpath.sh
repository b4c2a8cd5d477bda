#!/usr/bin/env bash
# The CPU decode fast path (issue 11) in docs/performance.md: `bench serving` against three
# servers started side by side on the default model in its default dtype: the portable path
# (torch_native attention, dequantized weights), --attention-backend cpu_paged, and cpu_paged
# with --quantization int4. Runs alternate between the servers in each round, so a shared
# machine's drift falls on all alike. Usage: scripts/fastpath.sh [OUT_DIR]  (~20 min, 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-/tmp/radixserve-fastpath}
ROUNDS=${ROUNDS:-1}
CONCURRENCIES=${CONCURRENCIES:-"1 32"}
mkdir -p "$OUT"
PORTS=(30141 30142 30143)
NAMES=(portable cpu_paged cpu_paged-int4)
FLAGS=("--attention-backend torch_native" "--attention-backend cpu_paged" "--attention-backend cpu_paged --quantization int4")
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

for i in 0 1 2; do
  # shellcheck disable=SC2086
  start_server "$OUT/server-${NAMES[$i]}.log" "${PORTS[$i]}" ${FLAGS[$i]}
done
wait_healthy "${PORTS[@]}"

for r in $(seq 1 "$ROUNDS"); do
  for c in $CONCURRENCIES; do
    n=$(( c == 1 ? 3 : c ))
    for i in 0 1 2; do
      $PY -m radixserve bench serving --backend radixserve --port "${PORTS[$i]}" --disable-tqdm \
        --flush-cache --dataset-name random --random-input-len 200 --random-output-len 128 \
        --random-range-ratio 1.0 --num-prompts "$n" --max-concurrency "$c" \
        --tag "${NAMES[$i]}-c$c-r$r" --output-file "$OUT/serving.jsonl" > /dev/null
    done
    echo "round $r, concurrency $c done"
  done
done

$PY - "$OUT/serving.jsonl" << 'PYEOF'
import json, sys
print("| server | concurrency | output tok/s | median TPOT ms | mean TTFT ms |")
print("|---|---:|---:|---:|---:|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r.get('tag')} | {r.get('max_concurrency')} | {r.get('output_throughput', 0):.1f} | "
          f"{r.get('median_tpot_ms', 0):.1f} | {r.get('mean_ttft_ms', 0):.0f} |")
PYEOF
