#!/usr/bin/env bash
# Installs what the tests need (venv, test extras, etcd-server, vLLM's CPU build) and runs the suite.
# Usage: bash scripts/test.sh [--full] [pytest args...]   (--full adds the slow load/soak tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" test --etcd --vllm
cd "$ROOT"
exec python -m pytest "$@"
