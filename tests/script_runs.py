"""Running the example scripts and benchmark entry points in tests: `needs_di`, a run interrupted by Ctrl-C,
port checks."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, wait_until


def script_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def worker_has_di_roles() -> bool:
    """True when `python -m worker --help` offers the KV-transfer flags of the prefill/decode roles."""
    shown = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=script_env())
    return "--kv-transport" in shown.stdout


needs_di = pytest.mark.skipif(not worker_has_di_roles(), reason="the worker has no prefill/decode roles yet")


def command(script: str) -> list[str]:
    """How the README runs `script`: a file (`examples/epd.py`) as a file, a module (`benchmarks.bench_sweep`)
    with -m, from the repo root."""
    return [sys.executable, script] if script.endswith(".py") else [sys.executable, "-m", script]


def run_script(script: str, *args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command(script), *args], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def interrupted_run(log: Path, script: str, *args: str, marker: str) -> tuple[int, str]:
    """Runs a script, sends SIGINT once `marker` is in its output; its exit status and output."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command(script), *args], cwd=ROOT, env=script_env(),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is not None or marker in log.read_text(), timeout=240, what=marker)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=60), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def stack_ports(output: str) -> list[int]:
    """The proxy's, prefill's and decode's ports from the script's `proxy URL -> prefill URL, decode URL` line."""
    line = next(line for line in output.splitlines() if line.startswith("proxy http://"))
    ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", line)]
    assert len(ports) == 3, line
    return ports


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0
