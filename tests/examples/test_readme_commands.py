"""The commands of README.md and docs/, copied out of the page that shows them and run as written on a fresh copy of the repository.

A fresh clone is the repository's tracked files only (no build products, no caches); the set-up's
result, `.venv`, is this interpreter's environment, and the package resolves to the copy (as the
set-up's editable install makes it). Each command runs after `source .venv/bin/activate`, the set-up
block's own command; the only changes made to them are that the stack's default ports (8000, 8100, 8200,
14579) become free ones, since other servers may hold those here, and /etc becomes a temporary directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from stack.serving import Process, free_port
from tests.helpers import ROOT, wait_until

README = ROOT / "README.md"
DOCS = ROOT / "docs"
DEFAULT_PORTS = (8000, 8100, 8200, 14579)


def bash_blocks(text: str) -> list[list[str]]:
    """The README's ```bash blocks, each as its commands (continued lines joined)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [re.sub(r"\\\n\s*", "", block).splitlines() for block in blocks]


def block_with(fragment: str, page: Path = README) -> list[str]:
    """The commands of the one bash block of `page` holding `fragment`."""
    found = [block for block in bash_blocks(page.read_text()) if any(fragment in line for line in block)]
    assert len(found) == 1, f"{len(found)} blocks of {page.relative_to(ROOT)} hold {fragment!r}"
    return [line for line in found[0] if line.strip()]


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    clone = tmp_path_factory.mktemp("clone") / "neuron-di"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    (clone / ".venv").symlink_to(Path(sys.prefix))  # what `bash scripts/demo.sh` or `scripts/test.sh` made
    return clone


@pytest.fixture
def as_written(fresh_clone: Path, tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Runs README commands in the copy after activating its venv: in the background (servers), or to the end."""
    ports = {port: free_port() for port in DEFAULT_PORTS}
    started: list[Process] = []

    def run(command: str, background: bool = False, timeout: float = 120) -> object:
        for default, port in ports.items():
            command = re.sub(rf"\b{default}\b", str(port), command)
        command = command.replace("/etc/", f"{tmp_path}/")
        script = f"set -e; cd {fresh_clone}; source .venv/bin/activate; {command}"
        env = {"PYTHONPATH": str(fresh_clone), "OMP_NUM_THREADS": "1"}
        if background:
            started.append(Process("readme", ["-c", script], env=env, program="bash"))
            return started[-1]
        return subprocess.run(["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=timeout)

    yield run
    for process in reversed(started):
        process.stop()


def test_the_set_up_says_to_activate_the_venv() -> None:
    assert block_with("source .venv/bin/activate") == ["source .venv/bin/activate"]


def test_the_kv_secret_command_makes_a_file_only_its_owner_reads(as_written, tmp_path: Path) -> None:
    make = block_with("--kv-secret-file", DOCS / "security.md")[0]
    result = as_written(make)
    assert result.returncode == 0, result.stderr
    secret = tmp_path / "neuron-di" / "kv-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text().strip()) == 44


def test_the_by_hand_stack_serves_the_readme_requests(as_written) -> None:
    by_hand = block_with("python -m worker --role prefill --port 8100", DOCS / "serving.md")
    servers, probes = [c for c in by_hand if c.startswith("python ")], [c for c in by_hand if c.startswith("curl ")]
    assert len(servers) == 3 and len(probes) == 1
    processes = [as_written(command, background=True) for command in servers]

    def ready_or_dead() -> list[str] | bool:
        dead = [process.tail() for process in processes if process.proc.poll() is not None]
        return dead or as_written(probes[0]).returncode == 0
    assert wait_until(ready_or_dead, timeout=180, interval=0.5, what="the README's /ready probe") is True
    # The completion request of the launcher block, against the same ports.
    curl = next(c for c in block_with("bash examples/launch_1p1d.sh", DOCS / "serving.md") if c.startswith("curl "))
    answer = as_written(curl)
    assert answer.returncode == 0, answer.stderr
    body = json.loads(answer.stdout)
    assert body["model"] == "neuron-di-builtin" and body["usage"]["completion_tokens"] == 16, body


@pytest.mark.slow  # tests/examples/test_neuron_di.py runs the same script by default, with fewer tokens
def test_the_offline_check_runs_as_written(as_written) -> None:
    first = block_with("python examples/neuron_di.py", DOCS / "getting-started.md")[0]
    result = as_written(first, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "outputs match: 8 prompts" in result.stdout
