#!/usr/bin/env bash
# Two radixserve servers behind SGLang's router (the sglang-router package) on this machine,
# until Ctrl-C; any end (Ctrl-C, SIGTERM, the router or a server exiting) stops all three.
#   scripts/router.sh                  # servers on :30001 and :30002, the router on :30000
#   ROUTER_PORT=8000 WORKER_PORTS="31001 31002" POLICY=round_robin scripts/router.sh
#   SERVER_ARGS="--model-path /models/x.gguf --dp-size 2" scripts/router.sh
#   SMOKE=1 scripts/router.sh          # one request through the router, then stop
#   PD=1 scripts/router.sh             # P/D: the first server prefills, the second decodes
# POLICY: cache_aware (default), round_robin, random, power_of_two. Logs: LOG_DIR.
# PD=1: BOOTSTRAP_PORT (8998) is the prefill server's bootstrap port, TRANSFER_BACKEND
# (mooncake; fake needs no package) moves the KV (docs/disaggregation.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROUTER_HOST=${ROUTER_HOST:-127.0.0.1}  # 0.0.0.0: clients on other machines
ROUTER_PORT=${ROUTER_PORT:-30000}
read -r -a WORKER_PORTS <<< "${WORKER_PORTS:-30001 30002}"
POLICY=${POLICY:-cache_aware}
LOG_DIR=${LOG_DIR:-/tmp/radixserve-router}
read -r -a SERVER_FLAGS <<< "${SERVER_ARGS:-}"
# The servers share this machine's cores: each gets its share of torch threads (two servers
# with a thread per core each would fight over every core), unless SERVER_ARGS says otherwise.
if [[ " ${SERVER_ARGS:-} " != *" --num-threads "* ]]; then
  threads=$(( $(nproc) / ${#WORKER_PORTS[@]} ))
  SERVER_FLAGS+=(--num-threads $(( threads > 0 ? threads : 1 )))
fi
# The router's own metrics port (its default, 29000, is taken by any other router running).
PROMETHEUS_PORT=${PROMETHEUS_PORT:-$($PY -c 'from radixserve.utils import free_port; print(free_port())')}
mkdir -p "$LOG_DIR"
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap 'exit 130' INT
trap 'exit 143' TERM

urls=()
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
TRANSFER_BACKEND=${TRANSFER_BACKEND:-mooncake}
for i in "${!WORKER_PORTS[@]}"; do
  port=${WORKER_PORTS[$i]}
  role=()
  if [[ -n "${PD:-}" ]]; then
    (( ${#WORKER_PORTS[@]} == 2 )) || { echo "PD=1 needs two WORKER_PORTS" >&2; exit 2; }
    role=(--disaggregation-transfer-backend "$TRANSFER_BACKEND" --disaggregation-mode)
    if (( i == 0 )); then
      role+=(prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT")
    else
      role+=(decode)
    fi
  fi
  start_server "$LOG_DIR/server-$port.log" "$port" ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"} \
    ${role[@]+"${role[@]}"}
  urls+=("http://127.0.0.1:$port")
done
wait_healthy "${WORKER_PORTS[@]}"

workers=(--worker-urls "${urls[@]}" --policy "$POLICY")
if [[ -n "${PD:-}" ]]; then
  workers=(--pd-disaggregation --prefill "${urls[0]}" "$BOOTSTRAP_PORT" --decode "${urls[1]}")
fi
$PY -m sglang_router.launch_router "${workers[@]}" \
  --host "$ROUTER_HOST" --port "$ROUTER_PORT" \
  --prometheus-host 127.0.0.1 --prometheus-port "$PROMETHEUS_PORT" \
  > "$LOG_DIR/router.log" 2>&1 &
ROUTER_PID=$!
PIDS+=("$ROUTER_PID")
router=http://127.0.0.1:$ROUTER_PORT
for _ in $(seq 1 120); do  # every worker registered: the router lists the model
  curl -sf "$router/v1/models" 2> /dev/null | grep -q '"id"' && break
  kill -0 "$ROUTER_PID" 2> /dev/null || { echo "the router exited: $LOG_DIR/router.log" >&2; exit 1; }
  sleep 0.5
done
curl -sf "$router/v1/models" | grep -q '"id"' \
  || { echo "the router did not register the workers: $LOG_DIR/router.log" >&2; exit 1; }
echo "router (${PD:+PD, }$POLICY) on http://$ROUTER_HOST:$ROUTER_PORT in front of ${urls[*]}; logs in $LOG_DIR; Ctrl-C stops all"

if [[ -n "${SMOKE:-}" ]]; then
  curl -sf "$router/generate" -H 'Content-Type: application/json' \
    -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}'
  echo
  exit 0
fi
wait -n "${PIDS[@]}" || true  # the first of the router and the servers to exit ends it all
echo "a server or the router exited; stopping (logs in $LOG_DIR)" >&2
exit 1
