# Process handling shared by launch_1p1d.sh and launch_xpyd.sh (sourced, not run).
# Every child runs in a session of its own, so stopping it stops everything it started; on
# Ctrl-C, SIGTERM or any exit the launcher stops every child (SIGTERM, then SIGKILL).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-300}"
STOP_TIMEOUT="${STOP_TIMEOUT:-15}"
LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/neuron-di-launch.XXXXXX")"
CHILD_PIDS=()
CHILD_NAMES=()
KEEP_LOGS=0

# start NAME COMMAND...: runs COMMAND in its own session, output to $LOG_DIR/NAME.log.
start() {
  local name="$1"; shift
  setsid "$@" >"$LOG_DIR/$name.log" 2>&1 < /dev/null &
  CHILD_PIDS+=("$!")
  CHILD_NAMES+=("$name")
  echo "started $name (pid $!): $*"
}

alive() { kill -0 "$1" 2>/dev/null; }

# fail MESSAGE [NAME]: prints MESSAGE and the tail of NAME's log, keeps the logs, exits 1.
fail() {
  echo "error: $1" >&2
  if [ -n "${2:-}" ]; then tail -n 40 "$LOG_DIR/$2.log" >&2 || true; fi
  KEEP_LOGS=1
  exit 1
}

# wait_for NAME CHECK...: polls the command CHECK until it succeeds; fails when any child exits
# or at the deadline.
wait_for() {
  local name="$1"; shift
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    check_children
    [ "$SECONDS" -lt "$deadline" ] || fail "$name not ready after $STARTUP_TIMEOUT s" "$name"
    sleep 0.2
  done
  echo "$name is ready"
}

check_children() {
  local i
  for i in "${!CHILD_PIDS[@]}"; do
    alive "${CHILD_PIDS[i]}" || fail "${CHILD_NAMES[i]} exited" "${CHILD_NAMES[i]}"
  done
}

http_ok() { curl -sf --max-time 2 "$1"; }

# wait_proxy_ready PORT: waits until the proxy on PORT answers GET /ready with 200, i.e. has a healthy
# worker of every role it needs (its /health answers 200 as soon as the proxy itself runs).
wait_proxy_ready() { wait_for proxy http_ok "http://127.0.0.1:$1/ready"; }

stop_all() {
  local i pid deadline
  for ((i = ${#CHILD_PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM -- "-${CHILD_PIDS[i]}" 2>/dev/null || true
  done
  deadline=$((SECONDS + STOP_TIMEOUT))
  for pid in "${CHILD_PIDS[@]}"; do
    while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ ${#CHILD_PIDS[@]} -gt 0 ]; then echo "stopped ${CHILD_NAMES[*]}"; fi
  if [ "$KEEP_LOGS" = 1 ]; then echo "logs kept in $LOG_DIR" >&2; else rm -rf "$LOG_DIR"; fi
}

trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# serve_forever: returns when a child exits (then the EXIT trap stops the rest) or on a signal;
# `wait -n` returns at once on a trapped signal, so Ctrl-C is acted on immediately.
serve_forever() {
  echo "logs in $LOG_DIR; press Ctrl-C to stop everything"
  wait -n || true
  check_children
}
