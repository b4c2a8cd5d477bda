#!/usr/bin/env bash
# The CUDA checks of docs/performance.md ("CUDA graphs on a GPU", and the overlap section's
# GPU run), on a machine with an NVIDIA GPU and the project's dependencies importable by $PY:
#  1. the CUDA graph runner's tests (tests/model_executor/test_cuda_graph_runner.py);
#  2. `bench one-batch` with and without --disable-cuda-graph, for each model directory in
#     $MODELS (a config.json, with random weights: --load-format dummy, as the docs' run);
#  3. `bench serving` at concurrency 1, 8, 32, 64 against two servers side by side on the first
#     model (overlap loop, --disable-overlap-schedule), rounds alternating; the first model's
#     directory must hold its tokenizer too.
# Usage: MODELS="dir1 dir2" scripts/cuda_checks.sh [OUT_DIR]  (~6 min on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-/tmp/radixserve-cuda}
ROUNDS=${ROUNDS:-2}
read -r -a MODELS <<< "${MODELS:?MODELS: model directories (config.json)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

$PY -m pytest -q -p no:cacheprovider tests/model_executor/test_cuda_graph_runner.py \
  2>&1 | tee "$OUT/pytest.log" | tail -5

for model in "${MODELS[@]}"; do
  for flag in "" "--disable-cuda-graph"; do
    echo "== one-batch $model $flag"
    $PY -m radixserve bench one-batch --model-path "$model" --load-format dummy \
      --dtype bfloat16 --max-total-tokens 200000 --batch-size 1 8 32 64 --input-len 256 \
      --output-len 64 $flag --output-file "$OUT/one_batch.jsonl" 2>&1 | tail -6
  done
done

M=(--model-path "${MODELS[0]}" --load-format dummy --dtype bfloat16)
PORTS=(30131 30132)
LOOPS=(overlap normal)
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
start_server "$OUT/server-overlap.log" "${PORTS[0]}" "${M[@]}"
start_server "$OUT/server-normal.log" "${PORTS[1]}" "${M[@]}" --disable-overlap-schedule
wait_healthy "${PORTS[@]}"
for r in $(seq 1 "$ROUNDS"); do
  for c in 1 8 32 64; do
    if (( r % 2 )); then order=(0 1); else order=(1 0); fi
    for i in "${order[@]}"; do
      n=$(( c == 1 ? 4 : (c == 8 ? 16 : 2 * c) ))
      $PY -m radixserve bench serving --backend radixserve --port "${PORTS[$i]}" \
        --disable-tqdm --tokenizer "${MODELS[0]}" --flush-cache --dataset-name random \
        --random-input-len 128 --random-output-len 128 --random-range-ratio 1.0 \
        --num-prompts "$n" --max-concurrency "$c" --tag "${LOOPS[$i]}-c$c-r$r" \
        --output-file "$OUT/serving.jsonl" > /dev/null
    done
  done
done
stop_servers
PIDS=()
$PY scripts/serving_table.py "$OUT/serving.jsonl"
