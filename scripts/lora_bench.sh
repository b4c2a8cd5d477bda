#!/bin/bash
# The cost of serving through a LoRA adapter: one server with the adapter, `bench serving`
# against the base model and against the adapter (the OpenAI `model`), alternated, two rounds;
# one client (200 in / 128 out) and 32 (256 / 128). docs/performance.md, "LoRA adapters".
#
#   scripts/lora_bench.sh ADAPTER_DIR [PORT] [extra serve flags...]
#
# (The adapter there: tests/lora/test_lora.py's write_adapter(dir, model, r=16, seed=3,
# scale=0.03), random A and B on all seven projections.)
set -euo pipefail
cd "$(dirname "$0")/.."
ADAPTER=${1:?usage: scripts/lora_bench.sh ADAPTER_DIR [PORT] [serve flags...]}
PORT=${2:-30111}
shift $(( $# > 1 ? 2 : 1 ))
PY=.venv/bin/python
$PY -m radixserve serve --port "$PORT" --lora-paths "a=$ADAPTER" "$@" > /tmp/lora_bench_server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 300); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
sleep 5  # the start-up warm-up request
bench() {  # name, model flag..., then bench flags
  local name=$1; shift
  $PY -m radixserve bench serving --backend openai --port "$PORT" --dataset-name random \
    --disable-tqdm "$@" 2>&1 | grep -E "Output token throughput|Median (TTFT|TPOT|ITL)" \
    | sed "s/^/$name: /"
}
for round in 1 2; do
  for model in base a; do
    flags=(); [ "$model" = a ] && flags=(--model a)
    bench "c1 $model" "${flags[@]}" --random-input-len 200 --random-output-len 128 \
      --num-prompts 12 --max-concurrency 1 --seed "$round"
    bench "c32 $model" "${flags[@]}" --random-input-len 256 --random-output-len 128 \
      --num-prompts 64 --max-concurrency 32 --seed "$round"
  done
done
