#!/usr/bin/env bash
# Dynamic xPyD on this host: etcd on loopback, N prefill and M decode workers registering in it,
# and the proxy discovering them. Ctrl-C (or SIGTERM) stops everything it started; a worker that
# exits (a drain: POST /drain or SIGTERM to it) is reported and the others keep serving.
set -euo pipefail

usage() {
  cat <<USAGE
usage: examples/launch_xpyd.sh [options]

Starts etcd (loopback, temporary data dir), N prefill and M decode workers registered in it
and the proxy discovering them, all on 127.0.0.1, and serves until Ctrl-C. Worker i of a role
uses base port + i. A worker that exits (POST /drain, SIGTERM, a crash) is reported and the
others keep serving; the launcher stops once no worker is left. Logs are kept in a directory it
names. Each option can also be given as the environment variable in brackets.

  --num-prefill N       prefill workers (NUM_PREFILL; default 2)
  --num-decode M        decode workers (NUM_DECODE; default 2)
  --model PATH          model directory (MODEL; default: the built-in model)
  --proxy-port N        proxy HTTP port (PROXY_PORT; default 8000)
  --prefill-port N      first prefill worker HTTP port (PREFILL_PORT; default 8100)
  --kv-port N           first prefill worker's KV signal port (KV_PORT; default 14579)
  --decode-port N       first decode worker HTTP port (DECODE_PORT; default 8200)
  --etcd-port N         etcd client port (ETCD_PORT; default 2379)
  --etcd-peer-port N    etcd peer port (ETCD_PEER_PORT; default 2380)
  --kv-transport T      auto, shm or tcp (KV_TRANSPORT; default auto)
  --startup-timeout S   seconds each process may take to become ready (STARTUP_TIMEOUT; default 300)
  --status N            print a summary of the proxy's GET /status every N seconds (STATUS; default 0: never)
  -h, --help            show this help
USAGE
}

NUM_PREFILL="${NUM_PREFILL:-2}"
NUM_DECODE="${NUM_DECODE:-2}"
MODEL="${MODEL:-}"
PROXY_PORT="${PROXY_PORT:-8000}"
PREFILL_PORT="${PREFILL_PORT:-8100}"
KV_PORT="${KV_PORT:-14579}"
DECODE_PORT="${DECODE_PORT:-8200}"
ETCD_PORT="${ETCD_PORT:-2379}"
ETCD_PEER_PORT="${ETCD_PEER_PORT:-2380}"
KV_TRANSPORT="${KV_TRANSPORT:-auto}"
STATUS="${STATUS:-0}"
while [ $# -gt 0 ]; do
  case "$1" in
    --num-prefill) NUM_PREFILL="$2"; shift 2 ;;
    --num-decode) NUM_DECODE="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --proxy-port) PROXY_PORT="$2"; shift 2 ;;
    --prefill-port) PREFILL_PORT="$2"; shift 2 ;;
    --kv-port) KV_PORT="$2"; shift 2 ;;
    --decode-port) DECODE_PORT="$2"; shift 2 ;;
    --etcd-port) ETCD_PORT="$2"; shift 2 ;;
    --etcd-peer-port) ETCD_PEER_PORT="$2"; shift 2 ;;
    --kv-transport) KV_TRANSPORT="$2"; shift 2 ;;
    --startup-timeout) STARTUP_TIMEOUT="$2"; shift 2 ;;
    --status) STATUS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
done
for n in "$NUM_PREFILL" "$NUM_DECODE"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "worker counts must be at least 1, got $n" >&2; exit 2; }
done
command -v etcd >/dev/null || { echo "etcd not found: sudo apt-get install etcd-server" >&2; exit 1; }

source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
MODEL_ARGS=()
if [ -n "$MODEL" ]; then MODEL_ARGS=(--model "$MODEL"); fi
cd "$ROOT"

# etcd's data goes when the launcher does; its log stays with the others.
SCRATCH_DIRS+=("$LOG_DIR/etcd-data")
start etcd etcd --name neuron-di --data-dir "$LOG_DIR/etcd-data" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "neuron-di=http://127.0.0.1:$ETCD_PEER_PORT"
wait_for etcd http_ok "http://127.0.0.1:$ETCD_PORT/health"

ETCD="127.0.0.1:$ETCD_PORT"
for ((i = 0; i < NUM_PREFILL; i++)); do
  start_worker "prefill$i" "$PYTHON" -m worker --role prefill --host 127.0.0.1 --port $((PREFILL_PORT + i)) \
    --kv-port $((KV_PORT + i)) --kv-transport "$KV_TRANSPORT" --etcd "$ETCD" "${MODEL_ARGS[@]}"
done
for ((i = 0; i < NUM_DECODE; i++)); do
  start_worker "decode$i" "$PYTHON" -m worker --role decode --host 127.0.0.1 --port $((DECODE_PORT + i)) \
    --kv-transport "$KV_TRANSPORT" --etcd "$ETCD" "${MODEL_ARGS[@]}"
done
start proxy "$PYTHON" proxy_server.py --host 127.0.0.1 --port "$PROXY_PORT" --etcd "$ETCD"

# Ready when GET /ready says so (a healthy worker of each role) and the proxy has discovered every
# worker in etcd and health-checked it.
wait_proxy_ready "$PROXY_PORT"
workers_healthy() {
  curl -sf --max-time 2 "http://127.0.0.1:$PROXY_PORT/health" | "$PYTHON" -c '
import json, sys
workers = json.load(sys.stdin)["workers"]
sys.exit(not (workers["prefill"]["healthy"] >= int(sys.argv[1]) and workers["decode"]["healthy"] >= int(sys.argv[2])))
' "$NUM_PREFILL" "$NUM_DECODE"
}
wait_for proxy workers_healthy
echo "${NUM_PREFILL}P${NUM_DECODE}D serving on http://127.0.0.1:$PROXY_PORT/v1 (etcd $ETCD)"
show_status "$STATUS" "$PROXY_PORT"
serve_forever
