"""What the warm-start server imports once for every process it forks (see tests/warm_start.py).

libgomp reads its settings when torch loads, so they are set first, as `python -m worker` and
`tests/worker_process.py` set them for a worker started cold.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["OMP_NUM_THREADS"] = "1"

import aiohttp.web  # noqa: E402,F401 - with tests.proxy.registration, what tests/proxy/fake_worker.py imports
import torch  # noqa: E402,F401 - after the environment above

import planner.cli  # noqa: E402,F401
import proxy_server  # noqa: E402,F401
import tests.proxy.registration  # noqa: E402,F401
import worker.server.app  # noqa: E402,F401
import worker.server.cli  # noqa: E402,F401
