#!/usr/bin/env bash
# Static 1P1D on this host: a prefill worker, a decode worker and the proxy in front of them.
# Ctrl-C (or SIGTERM) stops everything it started; a worker that exits (a drain) is reported.
set -euo pipefail

usage() {
  cat <<USAGE
usage: examples/launch_1p1d.sh [options]

Starts a prefill worker, a decode worker and the proxy on 127.0.0.1 and serves until Ctrl-C.
A worker that exits (POST /drain, SIGTERM, a crash) is reported; the launcher stops once no
worker is left. Logs are kept in a directory it names. Each option can also be given as the
environment variable in brackets.

  --model PATH          model directory (MODEL; default: the built-in model)
  --proxy-port N        proxy HTTP port (PROXY_PORT; default 8000)
  --prefill-port N      prefill worker HTTP port (PREFILL_PORT; default 8100)
  --kv-port N           prefill worker's KV signal port (KV_PORT; default 14579)
  --decode-port N       decode worker HTTP port (DECODE_PORT; default 8200)
  --kv-transport T      auto, shm or tcp (KV_TRANSPORT; default auto)
  --startup-timeout S   seconds each process may take to become ready (STARTUP_TIMEOUT; default 300)
  --status N            print a summary of the proxy's GET /status every N seconds (STATUS; default 0: never)
  -h, --help            show this help
USAGE
}

MODEL="${MODEL:-}"
PROXY_PORT="${PROXY_PORT:-8000}"
PREFILL_PORT="${PREFILL_PORT:-8100}"
KV_PORT="${KV_PORT:-14579}"
DECODE_PORT="${DECODE_PORT:-8200}"
KV_TRANSPORT="${KV_TRANSPORT:-auto}"
STATUS="${STATUS:-0}"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --proxy-port) PROXY_PORT="$2"; shift 2 ;;
    --prefill-port) PREFILL_PORT="$2"; shift 2 ;;
    --kv-port) KV_PORT="$2"; shift 2 ;;
    --decode-port) DECODE_PORT="$2"; shift 2 ;;
    --kv-transport) KV_TRANSPORT="$2"; shift 2 ;;
    --startup-timeout) STARTUP_TIMEOUT="$2"; shift 2 ;;
    --status) STATUS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
done

ports=("$PROXY_PORT" "$PREFILL_PORT" "$DECODE_PORT" "$KV_PORT")
if [ "$(printf '%s\n' "${ports[@]}" | sort -u | wc -l)" != 4 ]; then
  echo "the proxy, prefill, decode and KV ports must differ, got ${ports[*]}" >&2; exit 2
fi

source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
MODEL_ARGS=()
if [ -n "$MODEL" ]; then MODEL_ARGS=(--model "$MODEL"); fi
cd "$ROOT"

start_worker prefill "$PYTHON" -m worker --role prefill --host 127.0.0.1 --port "$PREFILL_PORT" \
  --kv-port "$KV_PORT" --kv-transport "$KV_TRANSPORT" "${MODEL_ARGS[@]}"
start_worker decode "$PYTHON" -m worker --role decode --host 127.0.0.1 --port "$DECODE_PORT" \
  --kv-transport "$KV_TRANSPORT" "${MODEL_ARGS[@]}"
wait_for prefill worker_up "http://127.0.0.1:$PREFILL_PORT" prefill
wait_for decode worker_up "http://127.0.0.1:$DECODE_PORT" decode
# No --prefill-kv-port: the proxy reads the prefill worker's KV port from its GET /health answer.
start proxy "$PYTHON" proxy_server.py --host 127.0.0.1 --port "$PROXY_PORT" \
  --prefill-ip 127.0.0.1 --prefill-port "$PREFILL_PORT" --decode-ip 127.0.0.1 --decode-port "$DECODE_PORT"
wait_proxy_ready "$PROXY_PORT"
echo "1P1D serving on http://127.0.0.1:$PROXY_PORT/v1 (prefill :$PREFILL_PORT, decode :$DECODE_PORT)"
show_status "$STATUS" "$PROXY_PORT"
serve_forever
