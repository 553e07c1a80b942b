#!/usr/bin/env bash
# Installs neuron-di and runs the main job: a 1P1D stack (prefill worker, decode worker, proxy)
# on the built-in model, answering a few requests sent with the openai client.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" ""  # the base install; the demo's own arguments are not extras
cd "$ROOT"
exec python examples/demo_1p1d.py "$@"
