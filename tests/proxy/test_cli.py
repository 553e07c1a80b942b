"""`python proxy_server.py`: configuration errors stop it at start with a clear message."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_bad_command_line_fails_at_start() -> None:
    result = subprocess.run([sys.executable, "proxy_server.py", "--prefill-ip", "127.0.0.1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("proxy_server.py: error: static 1P1D needs all of "
                                     "--prefill-ip --prefill-port --decode-ip --decode-port")
