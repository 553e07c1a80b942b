"""examples/quickstart.py end to end: it talks to a real worker and always stops it, also on Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers import ROOT, wait_until
from tests.worker.server_helpers import WORKER_ENV


def start_quickstart(log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "examples/quickstart.py", "--max-tokens", "8"], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def worker_pid(log: Path) -> int:
    match = re.search(r"starting a worker \(pid (\d+)\)", log.read_text())
    assert match, log.read_text()
    return int(match.group(1))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_quickstart_prints_every_answer_and_stops_its_worker() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "quickstart.log"
        proc = start_quickstart(log)
        try:
            assert proc.wait(timeout=240) == 0, log.read_text()
        finally:
            proc.kill()
        text = log.read_text()
        for heading in ("=== completion:", "=== streamed completion:", "=== chat:", "=== streamed chat (with usage)"):
            assert heading in text, text
        assert text.count("--- tokens:") == 3 and text.rstrip().endswith("worker stopped")
        wait_until(lambda: gone(worker_pid(log)), timeout=10, what="worker process gone")


def test_quickstart_stops_its_worker_on_ctrl_c() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "quickstart.log"
        proc = start_quickstart(log)
        try:
            pid = wait_until(lambda: worker_pid(log), timeout=60, what="worker started")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 130, log.read_text()
        finally:
            proc.kill()
        assert "interrupted" in log.read_text()
        wait_until(lambda: gone(pid), timeout=10, what="worker process gone")
