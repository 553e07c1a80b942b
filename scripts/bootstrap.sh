#!/usr/bin/env bash
# Creates (or reuses) .venv in the repo root and installs neuron-di with the given extras.
# Usage: source scripts/bootstrap.sh [EXTRAS] [--etcd]
# Idempotent: a stamp keyed on setup.py skips pip when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-}"
WANT_ETCD="${2:-}"
PYTHON="${PYTHON:-python3}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# pip warns about every unreachable mirror path; keep real errors visible.
pip_install() { "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PYTHON" -m venv "$ROOT/.venv"
fi
stamp="$ROOT/.venv/.neuron-di-${EXTRAS:-base}"
# The C sources count too: a changed one must be compiled again.
want="$(cat "$ROOT/setup.py" "$ROOT"/transfer/*.c "$ROOT"/worker/layers/*.c | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  # torch first, pinned: anything depending on plain `torch` would otherwise fetch CUDA builds.
  pip_install torch==2.13.0
  spec="$ROOT"
  [ -n "$EXTRAS" ] && spec="$ROOT[$EXTRAS]"
  pip_install -e "$spec"
  echo "$want" > "$stamp"
fi
if [ "$WANT_ETCD" = "--etcd" ] && ! command -v etcd >/dev/null 2>&1; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq etcd-server etcd-client >/dev/null
  # The Debian package starts a system etcd on 2379; tests start their own on free ports.
  as_root systemctl disable --now etcd >/dev/null 2>&1 || true
fi
export PATH="$ROOT/.venv/bin:$PATH"
