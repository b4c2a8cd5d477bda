#!/usr/bin/env bash
# Speculative decoding (issue 12) in docs/performance.md: `bench serving` against two servers
# started side by side on the default model in its default dtype, one plain and one with
# --speculative-algorithm NGRAM. Workloads: one client on `rewrite` (repeat a passage of the
# Python docs: the answer quotes the prompt) and on `natural` (questions with nothing to
# quote), both greedy with EOS honoured; and 32 clients at once on `random` (200 in / 128 out).
# Runs alternate between the servers, so a shared machine's drift falls on both alike.
# Usage: [ROUNDS=n] [WORKLOADS="rewrite natural random32"] scripts/spec_bench.sh [OUT_DIR]
# (~12 min per round on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-/tmp/radixserve-spec}
ROUNDS=${ROUNDS:-1}
SOLO_PROMPTS=${SOLO_PROMPTS:-6}
WORKLOADS=${WORKLOADS:-"rewrite natural random32"}
mkdir -p "$OUT"
PORTS=(30151 30152)
NAMES=(plain ngram)
FLAGS=("" "--speculative-algorithm NGRAM")
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

for i in 0 1; do
  # shellcheck disable=SC2086
  start_server "$OUT/server-${NAMES[$i]}.log" "${PORTS[$i]}" ${FLAGS[$i]}
done
wait_healthy "${PORTS[@]}"

bench() {  # server index, tag, extra args...
  local i=$1 tag=$2
  shift 2
  $PY -m radixserve bench serving --backend radixserve --port "${PORTS[$i]}" --disable-tqdm \
    --tag "${NAMES[$i]}-$tag" --output-file "$OUT/serving.jsonl" "$@" > /dev/null
}

for r in $(seq 1 "$ROUNDS"); do
  for w in $WORKLOADS; do
    # Alternate which server goes first from round to round.
    for i in $(( r % 2 )) $(( (r + 1) % 2 )); do
      case $w in
        rewrite) bench "$i" "rewrite-c1" --dataset-name rewrite --rewrite-passage-len 200 \
          --random-output-len 256 --num-prompts "$SOLO_PROMPTS" --max-concurrency 1 \
          --disable-ignore-eos --seed "$r" ;;
        natural) bench "$i" "natural-c1" --dataset-name natural --random-output-len 128 \
          --num-prompts "$SOLO_PROMPTS" --max-concurrency 1 --disable-ignore-eos --seed "$r" ;;
        random32) bench "$i" "random-c32" --flush-cache --dataset-name random \
          --random-input-len 200 --random-output-len 128 --num-prompts 32 \
          --max-concurrency 32 --seed "$r" ;;
      esac
    done
  done
  echo "round $r done"
done
for i in 0 1; do  # what each server measured (the speculation controller's step costs)
  curl -sf "http://127.0.0.1:${PORTS[$i]}/server_info" > "$OUT/server_info-${NAMES[$i]}.json" || true
done

$PY - "$OUT/serving.jsonl" << 'PYEOF'
import json, sys
print("| server | workload | output tok/s | median TPOT ms | accept length | accept rate |")
print("|---|---|---:|---:|---:|---:|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    name, _, load = r["tag"].partition("-")
    acc = r.get("spec_accept_length")
    rate = r.get("spec_accept_rate")
    print(f"| {name} | {load} | {r['output_throughput']:.1f} | {r['median_tpot_ms']:.1f} | "
          f"{'' if acc is None else f'{acc:.2f}'} | {'' if rate is None else f'{rate:.2f}'} |")
PYEOF
