"""Admission limits and the command line: a worker with one running slot and a one-deep queue."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stack.serving import free_port
from stack.worker_metrics import metric

from tests.helpers import ROOT, wait_until
from tests.worker_process import WorkerProcess
from worker.model.loader import builtin_model_path
from worker.server.cli import parse_args


def test_queue_full_is_503_then_the_worker_recovers() -> None:
    worker = WorkerProcess(extra=["--max-num-seqs", "1", "--max-waiting", "1"])
    try:
        max_len = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["max_model_len"]
        body = {"prompt": "Go on and on", "max_tokens": max_len // 2, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", f"{worker.url}/v1/completions", json=body) as running:
            running_lines = running.iter_lines()
            assert next(running_lines).startswith("data: ")  # admitted and running
            with client.stream("POST", f"{worker.url}/v1/completions", json=body) as waiting:
                wait_until(lambda: metric(worker.url, "neuron_di_requests_waiting") == 1, timeout=30,
                           what="second request queued")
                full = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert full.status_code == 503
                assert full.json()["error"]["type"] == "server_overloaded"
                assert full.json()["error"]["code"] == 503
                assert waiting.status_code == 200
        wait_until(lambda: metric(worker.url, "neuron_di_kv_blocks_used") == 0, timeout=30, what="blocks freed")
        ok = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert metric(worker.url, "neuron_di_requests_total", outcome="503") == 1
    finally:
        worker.stop()
    assert worker.proc.proc.returncode == 0, worker.proc.output()[-2000:]  # SIGTERM is a clean exit


@pytest.mark.parametrize("args,message", [
    (["--role", "decode", "--kv-port", "70000"], "--kv-port must be a TCP port or 0, got 70000"),
    (["--role", "prefill", "--kv-abort-timeout", "0"], "must be positive"),
    (["--role", "middle"], "invalid choice: 'middle'"),
    (["--port", "0"], "must be at least 1, got 0"),
    (["--port", "70000"], "not a TCP port: 70000"),
    (["--max-num-seqs", "x"], "expected an integer, got 'x'"),
    (["--block-size", "-16"], "must be at least 1, got -16"),
    (["--drain-timeout", "-1"], "--drain-timeout must be at least 0, got -1"),
])
def test_bad_command_line_is_rejected_up_front(args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


HEAVY_MODULES = ("torch", "quart", "zmq", "safetensors", "tokenizers")
_RUN_HELP = """
import runpy, sys
sys.argv = ["python -m worker", "--help"]
try:
    runpy.run_module("worker", run_name="__main__")
except SystemExit as exit_:
    assert exit_.code == 0, exit_.code
print(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:])))
"""


def test_python_m_worker_help_loads_no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _RUN_HELP, *HEAVY_MODULES], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "--kv-transport" in done.stdout
    assert done.stdout.splitlines()[-1] == "[]"


def test_python_m_worker_exits_2_on_a_bad_kv_port() -> None:
    done = subprocess.run([sys.executable, "-m", "worker", "--role", "prefill", "--kv-port", "70000"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert "--kv-port must be a TCP port or 0, got 70000" in done.stderr


def test_python_m_worker_exits_2_at_once_on_a_model_path_without_a_config(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "worker", "--model", str(tmp_path), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert f"--model {tmp_path}: cannot read a Llama-family config from {tmp_path}/config.json" in done.stderr
    assert "starting the engine" not in done.stderr   # refused before torch and the engine load


def test_python_m_worker_exits_1_when_the_model_cannot_load(tmp_path: Path) -> None:
    """A config but no tokenizer or weights: the engine fails to start."""
    shutil.copy(builtin_model_path() / "config.json", tmp_path / "config.json")
    done = subprocess.run([sys.executable, "-m", "worker", "--model", str(tmp_path), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1
    assert f"engine failed to start: cannot load {tmp_path}/tokenizer.json" in done.stderr
