"""The worker's KV-plane flags: the secret file is checked at start-up, engine ids are unique by default."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.kv_secret import SECRET_FILE_ENV
from neuron_connector.vllm.config import NeuronConnectorConfig
from tests.helpers import ROOT
from worker.server.cli import parse_args


def secret_file(tmp_path: Path, text: str = "s3cret", mode: int = 0o600) -> Path:
    path = tmp_path / "kv-secret"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_private_secret_file_is_read(tmp_path: Path) -> None:
    args, _ = parse_args(["--role", "decode", "--kv-secret-file", str(secret_file(tmp_path, "s3cret\n"))])
    assert args.kv_secret == b"s3cret"


def test_the_environment_names_the_secret_file_when_the_flag_does_not(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret_file(tmp_path, "from-env")))
    assert parse_args(["--role", "prefill"])[0].kv_secret == b"from-env"
    monkeypatch.delenv(SECRET_FILE_ENV)
    assert parse_args(["--role", "prefill"])[0].kv_secret is None     # none: unauthenticated, as before


@pytest.mark.parametrize("text, mode, message", [
    ("", 0o600, "is empty"),
    ("  \n", 0o600, "is empty"),
    ("s3cret", 0o640, "is accessible by group or others (mode 0640); make it private: chmod 600"),
    ("s3cret", 0o604, "is accessible by group or others (mode 0604)"),
    ("s3cret", 0o000, "cannot read the KV secret file"),
])
def test_a_bad_secret_file_is_a_start_up_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                mode: int, message: str) -> None:
    path = secret_file(tmp_path, text, mode)
    if mode == 0o000 and os.access(path, os.R_OK):
        pytest.skip("running as root: file modes do not stop reads")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--role", "prefill", "--kv-secret-file", str(path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_m_worker_exits_2_on_a_missing_secret_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    done = subprocess.run([sys.executable, "-m", "worker", "--role", "decode", "--kv-secret-file", str(missing)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert f"cannot read the KV secret file {missing}: No such file or directory" in done.stderr


def test_default_engine_ids_are_unique_and_readable() -> None:
    ids = {parse_args(["--role", "decode", "--host", "0.0.0.0", "--port", "8200"])[0].engine_id for _ in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(rf"{re.escape(socket.gethostname())}:8200:[0-9a-f]{{8}}", i) for i in ids), ids
    assert parse_args(["--role", "decode", "--engine-id", "d-7"])[0].engine_id == "d-7"


def test_the_vllm_connector_takes_a_secret_file(tmp_path: Path) -> None:
    path = str(secret_file(tmp_path))
    assert NeuronConnectorConfig.from_vllm("kv_consumer", {"kv_secret_file": path}).kv_secret_file == path
    with pytest.raises(ValueError, match="kv_secret_file must be str"):
        NeuronConnectorConfig.from_vllm("kv_consumer", {"kv_secret_file": 7})
