#!/usr/bin/env bash
# Installs neuron-di and runs the main job: a worker on the built-in model answering a few requests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec python examples/quickstart.py "$@"
