#!/usr/bin/env bash
# Soak test (docs/reliability.md): start a server on a free 127.0.0.1 port, run
# `python -m radixserve bench soak` against it for DURATION seconds (streaming and plain requests,
# aborts, client disconnects, bad input, grammar requests), stop the server whatever happens,
# print the report. Exits non-zero when the soak finds a broken invariant or the server dies.
#
# Usage: scripts/soak.sh [--enable-integrity-checks] [-- EXTRA SERVER ARGS...]
# Environment: DURATION (600 s), WARMUP (15 s), CONCURRENCY (32), SEED (0), MODEL_PATH (default
#   model), MAX_TOTAL_TOKENS (16384), MAX_RUNNING_REQUESTS (16), MAX_QUEUED_REQUESTS (8)
#   (an empty value leaves the server's default), OUT (/tmp/radixserve-soak: soak.json,
#   server.log), PORT (a free one), LOG_LEVEL (warning), SOAK_ARGS (more driver flags, e.g.
#   "--max-new-tokens 32 --mix grammar=0").
# Example: DURATION=120 scripts/soak.sh --enable-integrity-checks -- --schedule-policy lpm
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DURATION=${DURATION:-600}
WARMUP=${WARMUP:-15}
CONCURRENCY=${CONCURRENCY:-32}
SEED=${SEED:-0}
OUT=${OUT:-/tmp/radixserve-soak}
LOG_LEVEL=${LOG_LEVEL:-warning}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-300}
# A KV pool that the workload fills, so that eviction and retraction run (and the integrity
# checks, which walk the pool every step, stay affordable). Empty: the server's default.
MAX_TOTAL_TOKENS=${MAX_TOTAL_TOKENS-16384}
# Overload: more clients than running + queued requests, so that some get a 503 (allowed).
MAX_RUNNING_REQUESTS=${MAX_RUNNING_REQUESTS-16}
MAX_QUEUED_REQUESTS=${MAX_QUEUED_REQUESTS-8}

server_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --enable-integrity-checks) server_args+=("$1"); shift ;;
    --) shift; server_args+=("$@"); break ;;
    *) echo "usage: $0 [--enable-integrity-checks] [-- EXTRA SERVER ARGS...]" >&2; exit 2 ;;
  esac
done
[ -n "${MODEL_PATH:-}" ] && server_args+=(--model-path "$MODEL_PATH")
[ -n "$MAX_TOTAL_TOKENS" ] && server_args+=(--max-total-tokens "$MAX_TOTAL_TOKENS")
[ -n "$MAX_RUNNING_REQUESTS" ] && server_args+=(--max-running-requests "$MAX_RUNNING_REQUESTS")
[ -n "$MAX_QUEUED_REQUESTS" ] && server_args+=(--max-queued-requests "$MAX_QUEUED_REQUESTS")
PORT=${PORT:-$($PY -c 'from radixserve.utils import free_port; print(free_port())')}
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"

# Its own session, so that the whole process group (server, scheduler, detokenizer) can be
# killed if SIGTERM does not stop it.
setsid "$PY" -m radixserve serve --host 127.0.0.1 --port "$PORT" --log-level "$LOG_LEVEL" \
  ${server_args[@]+"${server_args[@]}"} > "$OUT/server.log" 2>&1 &
SERVER=$!

DRIVER=
stop_server() {
  trap - EXIT INT TERM
  [ -n "$DRIVER" ] && kill -TERM "$DRIVER" 2> /dev/null || true
  if kill -0 "$SERVER" 2> /dev/null; then
    kill -TERM "$SERVER" 2> /dev/null || true
    for _ in $(seq 1 60); do
      kill -0 "$SERVER" 2> /dev/null || break
      sleep 0.5
    done
  fi
  kill -KILL -- "-$SERVER" 2> /dev/null || true
  wait "$SERVER" 2> /dev/null || true
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

for _ in $(seq 1 $((STARTUP_TIMEOUT * 2))); do
  curl -sf "$URL/health" > /dev/null && break
  if ! kill -0 "$SERVER" 2> /dev/null; then
    echo "the server exited during start-up:" >&2; tail -n 40 "$OUT/server.log" >&2; exit 1
  fi
  sleep 0.5
done
curl -sf "$URL/health" > /dev/null || { echo "server not healthy after ${STARTUP_TIMEOUT} s" >&2; exit 1; }
echo "server ready on $URL (log: $OUT/server.log); soaking for ${DURATION} s"

rc=0
# In the background: bash runs a signal trap only once the foreground command is done, but a
# `wait` returns at once, so Ctrl-C or a SIGTERM stops the server now.
# shellcheck disable=SC2086  # SOAK_ARGS is a list of flags
"$PY" -m radixserve bench soak --base-url "$URL" --duration "$DURATION" --warmup "$WARMUP" \
  --concurrency "$CONCURRENCY" --seed "$SEED" --output "$OUT/soak.json" ${SOAK_ARGS:-} &
DRIVER=$!
wait "$DRIVER" || rc=$?
DRIVER=

if ! kill -0 "$SERVER" 2> /dev/null; then
  echo "the server died during the soak" >&2; rc=1
fi
# Every failure must be answered (an HTTP error, an error event); a traceback is one that was not.
if grep -q "Traceback" "$OUT/server.log"; then
  echo "FAIL: tracebacks in $OUT/server.log (first shown):" >&2
  grep -m1 -A30 "Traceback" "$OUT/server.log" >&2
  rc=1
fi
stop_server
echo "report: $OUT/soak.json   server log: $OUT/server.log"
exit $rc
