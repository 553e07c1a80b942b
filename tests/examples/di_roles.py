"""`needs_di`: skips tests of the DI stack while the worker has no prefill/decode roles."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def worker_has_di_roles() -> bool:
    """True when `python -m worker --help` offers the KV-transfer flags of the prefill/decode roles."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=env)
    return "--kv-transport" in shown.stdout


needs_di = pytest.mark.skipif(not worker_has_di_roles(), reason="the worker has no prefill/decode roles yet")
