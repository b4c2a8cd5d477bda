# Shared by the side-by-side benchmark scripts (fastpath.sh, overlap.sh, spec_bench.sh):
# start servers in the background, wait until they are healthy, stop them on exit.
# Expects PY (the venv's python) to be set; `source scripts/lib.sh` after `cd` to the repo.

PIDS=()

stop_servers() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2> /dev/null || true; done; wait || true; }
trap stop_servers EXIT

start_server() {  # start_server LOG_FILE PORT [serve flags...]
  local log=$1 port=$2
  shift 2
  $PY -m radixserve serve --port "$port" --max-total-tokens 40000 --log-level warning "$@" \
    > "$log" 2>&1 &
  PIDS+=($!)
}

wait_healthy() {  # wait_healthy PORT...  (up to 4 minutes each)
  local port
  for port in "$@"; do
    for _ in $(seq 1 480); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      sleep 0.5
    done
    curl -sf "http://127.0.0.1:$port/health" > /dev/null \
      || { echo "server :$port did not start" >&2; exit 1; }
  done
}
