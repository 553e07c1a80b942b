"""`python proxy_server.py`: configuration errors stop it at start; SIGTERM stops it cleanly."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from typing import Callable

import httpx

from tests.helpers import ROOT
from tests.proxy.conftest import Server, start_fake_worker, start_proxy


def test_bad_command_line_fails_at_start() -> None:
    result = subprocess.run([sys.executable, "proxy_server.py", "--prefill-ip", "127.0.0.1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("proxy_server.py: error: static 1P1D needs all of "
                                     "--prefill-ip --prefill-port --decode-ip --decode-port")


def test_conditional_disaggregation_without_a_tokenizer_fails_at_start() -> None:
    result = subprocess.run([sys.executable, "proxy_server.py", "--prefill", "127.0.0.1:8100", "--decode",
                             "127.0.0.1:8200", "--conditional-disaggregation"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("proxy_server.py: error: --conditional-disaggregation needs --tokenizer "
                                     "PATH|builtin to count prompt tokens")


def test_sigterm_stops_the_proxy_cleanly(servers: Callable[[Server], Server]) -> None:
    prefill = servers(start_fake_worker("prefill"))
    decode = servers(start_fake_worker("decode"))
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port)]))
    body = {"model": "fake-model", "prompt": "bye", "max_tokens": 2}
    assert httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30).status_code == 200
    proxy.process.proc.send_signal(signal.SIGTERM)
    assert proxy.process.proc.wait(timeout=20) == 0
    output = proxy.process.output()
    assert "Traceback" not in output and "Unclosed" not in output
    assert output.count(f"Running on http://127.0.0.1:{proxy.port}") == 1


def test_unknown_disaggregation_strategy_fails_at_start() -> None:
    result = subprocess.run([sys.executable, "proxy_server.py", "--etcd", "127.0.0.1:2379",
                             "--disaggregation-strategy", "decode-first"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("proxy_server.py: error: argument --disaggregation-strategy: invalid "
                                          "choice: 'decode-first' (choose from 'concurrent', 'prefill_first', "
                                          "'decode_first')")


def test_a_port_in_use_stops_the_proxy_at_once_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "proxy_server.py", "--port", str(port), "--prefill",
                                 "127.0.0.1:8100", "--decode", "127.0.0.1:8200"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"proxy_server.py: error: cannot listen on 127.0.0.1:{port}: Address already "
                                     "in use (another server listens there; pick another --port)")
