# Process handling shared by launch_1p1d.sh and launch_xpyd.sh (sourced, not run).
# Every child runs in a session of its own, so stopping it stops everything it started; on
# Ctrl-C, SIGTERM or any exit the launcher stops every child (SIGTERM, then SIGKILL). Logs are
# kept in $LOG_DIR, which the launcher names when it starts and when it stops.
#
# Children started with `start` (etcd, the proxy) are the fleet's own: if one exits, everything
# stops. Workers (`start_worker`) come and go: once serving, a worker that exits (after a drain:
# POST /drain or SIGTERM; or a crash) is reported and let go, and the others keep serving; the
# launcher stops when no worker is left.

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
CHILD_WORKER=()  # 1: a worker, which may leave; 0: etcd or the proxy, which the fleet needs
CHILD_GONE=()    # 1 once the child exited
SCRATCH_DIRS=()  # removed at exit (e.g. etcd's data); the logs stay

# start NAME COMMAND...: runs COMMAND in its own session, output to $LOG_DIR/NAME.log.
start() { _start 0 "$@"; }
start_worker() { _start 1 "$@"; }
_start() {
  local worker="$1" name="$2"; shift 2
  setsid "$@" >"$LOG_DIR/$name.log" 2>&1 < /dev/null &
  CHILD_PIDS+=("$!")
  CHILD_NAMES+=("$name")
  CHILD_WORKER+=("$worker")
  CHILD_GONE+=(0)
  echo "started $name (pid $!): $*"
}

alive() { kill -0 "$1" 2>/dev/null; }

# fail MESSAGE [NAME]: prints MESSAGE and the tail of NAME's log, exits 1.
fail() {
  echo "error: $1" >&2
  if [ -n "${2:-}" ]; then tail -n 40 "$LOG_DIR/$2.log" >&2 || true; fi
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

# worker_up URL ROLE: the worker at URL answers GET /health with 200 and says it has ROLE (so another
# process on that port, e.g. a worker of the other role, does not count).
worker_up() { curl -sf --max-time 2 "$1/health" | grep -q "\"role\": *\"$2\""; }

# wait_proxy_ready PORT: waits until the proxy on PORT answers GET /ready with 200, i.e. has a healthy
# worker of every role it needs (its /health answers 200 as soon as the proxy itself runs).
wait_proxy_ready() { wait_for proxy http_ok "http://127.0.0.1:$1/ready"; }

# show_status N PORT: prints a one-screen summary of the proxy's GET /status every N seconds on the
# terminal (N=0: never); stopped with everything else.
show_status() {
  [[ "$1" =~ ^[0-9]+([.][0-9]+)?$ ]] || fail "--status takes a number of seconds, got $1"
  [ "$1" = 0 ] && return 0
  setsid "$PYTHON" -m stack.status_summary --url "http://127.0.0.1:$2" --every "$1" < /dev/null &
  CHILD_PIDS+=("$!")
  CHILD_NAMES+=("status")
  CHILD_WORKER+=(0)
  CHILD_GONE+=(0)
}

stop_all() {
  local i pid deadline
  for ((i = ${#CHILD_PIDS[@]} - 1; i >= 0; i--)); do
    [ "${CHILD_GONE[i]}" = 1 ] || kill -TERM -- "-${CHILD_PIDS[i]}" 2>/dev/null || true
  done
  deadline=$((SECONDS + STOP_TIMEOUT))
  for i in "${!CHILD_PIDS[@]}"; do
    [ "${CHILD_GONE[i]}" = 1 ] && continue
    pid="${CHILD_PIDS[i]}"
    while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ ${#CHILD_PIDS[@]} -gt 0 ]; then echo "stopped ${CHILD_NAMES[*]}"; fi
  rm -rf "${SCRATCH_DIRS[@]}"
  echo "logs kept in $LOG_DIR" >&2
}

trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# workers_left [ROLE]: how many workers (whose names start with ROLE) still run.
workers_left() {
  local i count=0
  for i in "${!CHILD_PIDS[@]}"; do
    if [ "${CHILD_WORKER[i]}" = 1 ] && [ "${CHILD_GONE[i]}" = 0 ] && [[ "${CHILD_NAMES[i]}" == "${1:-}"* ]]; then
      count=$((count + 1))
    fi
  done
  echo "$count"
}

# serve_forever: waits for children to exit until Ctrl-C or SIGTERM (`wait -n` returns at once on a
# trapped signal). A worker that exits is reported and let go; etcd or the proxy exiting, or the last
# worker leaving, stops everything (exit status 0 only if every worker exited 0, i.e. drained).
serve_forever() {
  local pid status i role failed=0
  echo "logs in $LOG_DIR; press Ctrl-C to stop everything"
  while true; do
    status=0 pid=""
    wait -n -p pid || status=$?
    if [ -z "$pid" ]; then
      [ "$status" = 127 ] && fail "no child left to wait for"  # never spin on an empty job table
      continue
    fi
    for i in "${!CHILD_PIDS[@]}"; do [ "${CHILD_PIDS[i]}" = "$pid" ] && break; done
    CHILD_GONE[i]=1
    if [ "${CHILD_WORKER[i]}" = 0 ]; then
      fail "${CHILD_NAMES[i]} exited with status $status" "${CHILD_NAMES[i]}"
    fi
    if [ "$status" = 0 ]; then
      echo "${CHILD_NAMES[i]} exited after draining (status 0); the other workers keep serving"
    else
      failed=1
      echo "error: ${CHILD_NAMES[i]} exited with status $status (log: $LOG_DIR/${CHILD_NAMES[i]}.log);" \
           "the other workers keep serving" >&2
      tail -n 20 "$LOG_DIR/${CHILD_NAMES[i]}.log" >&2 || true
    fi
    role="${CHILD_NAMES[i]%%[0-9]*}"
    if [ "$(workers_left "$role")" = 0 ]; then
      echo "warning: no $role worker left: the proxy answers 503 until one is started" >&2
    fi
    if [ "$(workers_left)" = 0 ]; then
      echo "no worker left; stopping"
      exit "$failed"
    fi
  done
}
