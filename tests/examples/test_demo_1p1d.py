"""examples/demo_1p1d.py, the README's main job: a real 1P1D stack answers through the openai client."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

from tests.examples.di_roles import needs_di
from tests.helpers import ROOT, wait_until


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@needs_di
def test_demo_answers_every_request_and_stops_the_stack():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "examples/demo_1p1d.py", "--max-tokens", "6", "--kv-transport", "tcp"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.count("=== completion (") == 2 and out.count("+ 6 completion tokens)") == 2
    for title in ("=== streamed completion", "=== chat: 'def add(a, b):'", "=== streamed chat: 'def add(a, b):'"):
        assert title in out
    assert out.rstrip().endswith("stopped the proxy and both workers")
    ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", out.splitlines()[1])]
    assert len(ports) == 3 and not any(_listening(port) for port in ports)


@needs_di
def test_ctrl_c_stops_the_whole_stack(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        demo = subprocess.Popen([sys.executable, "examples/demo_1p1d.py", "--max-tokens", "200"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: demo.poll() is not None or "serving " in log.read_text(), timeout=240)
        assert demo.poll() is None, log.read_text()
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 130, log.read_text()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
    text = log.read_text()
    assert "interrupted; every process was stopped" in text
    ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", text.splitlines()[1])]
    assert len(ports) == 3 and not any(_listening(port) for port in ports)


def test_demo_reports_a_stack_that_cannot_start(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "examples/demo_1p1d.py", "--model", str(tmp_path / "missing")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 1
    assert "demo failed: the " in result.stderr and "worker exited with status" in result.stderr
