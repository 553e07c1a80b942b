"""examples/launch_1p1d.sh and launch_xpyd.sh: real stacks up, one request, Ctrl-C, nothing left behind."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.script_runs import needs_di
from stack.serving import free_port
from tests.helpers import ROOT, wait_until

LAUNCH_1P1D = ROOT / "examples" / "launch_1p1d.sh"
LAUNCH_XPYD = ROOT / "examples" / "launch_xpyd.sh"


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "STARTUP_TIMEOUT": "240",
            "PYTHONPATH": str(ROOT), **extra}


class Launcher:
    """A launcher script run as a child in its own session, output to a file."""

    def __init__(self, script: Path, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(["bash", str(script), *args], cwd=ROOT, env=_env(env), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.descendants: set[int] = set()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def remember_descendants(self) -> None:
        self.descendants |= _descendants(self.proc.pid)

    def interrupt(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """Last-resort cleanup when a test failed half way: every process this launcher started."""
        self.remember_descendants()
        for pid in [self.proc.pid, *self.descendants]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(timeout=30)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _gone(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _port_free(port: int) -> bool:
    # SO_REUSEADDR, as servers bind: closed connections in TIME_WAIT do not count, a listener does.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def launch(tmp_path):
    started: list[Launcher] = []

    def run(script: Path, args: list[str], env: dict[str, str]) -> Launcher:
        launcher = Launcher(script, args, env, tmp_path / f"launcher-{len(started)}.log")
        started.append(launcher)
        return launcher

    yield run
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.kill()
        logs = re.search(r"logs (?:kept )?in (\S+?);?$", launcher.output(), re.M)
        if logs:
            shutil.rmtree(logs.group(1), ignore_errors=True)


@pytest.mark.parametrize("script", [LAUNCH_1P1D, LAUNCH_XPYD], ids=["1p1d", "xpyd"])
def test_help_and_bad_option(script):
    shown = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--proxy-port" in shown.stdout and "--kv-transport" in shown.stdout
    bad = subprocess.run(["bash", str(script), "--no-such-flag"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown option: --no-such-flag" in bad.stderr


def test_1p1d_rejects_two_servers_on_one_port():
    result = subprocess.run(["bash", str(LAUNCH_1P1D), "--prefill-port", "8200"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    assert "the proxy, prefill, decode and KV ports must differ, got 8000 8200 8200 14579" in result.stderr


def test_xpyd_rejects_zero_workers():
    result = subprocess.run(["bash", str(LAUNCH_XPYD), "--num-decode", "0"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and "worker counts must be at least 1, got 0" in result.stderr


def test_failed_startup_stops_the_other_children(launch, tmp_path):
    ports = {name: str(free_port()) for name in ("PROXY_PORT", "PREFILL_PORT", "DECODE_PORT", "KV_PORT")}
    launcher = launch(LAUNCH_1P1D, ["--model", str(tmp_path / "no-such-model")], ports)
    wait_until(lambda: launcher.remember_descendants() or launcher.proc.poll() is not None, timeout=120)
    assert launcher.proc.returncode == 1, launcher.output()
    assert re.search(r"error: (prefill|decode) exited", launcher.output())
    assert "logs kept in" in launcher.output()
    wait_until(lambda: all(_gone(pid) for pid in launcher.descendants), timeout=30)
    assert all(_port_free(int(port)) for port in ports.values())


def _serve_one(launcher: Launcher, proxy_port: int, ready) -> None:
    url = f"http://127.0.0.1:{proxy_port}"
    wait_until(lambda: launcher.proc.poll() is not None or ready(), timeout=300)
    assert launcher.proc.poll() is None, launcher.output()
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200  # it says it serves once the proxy is ready
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    launcher.remember_descendants()
    assert len(launcher.descendants) >= 3


def _interrupt_stops_everything(launcher: Launcher, ports: list[int]) -> None:
    assert launcher.interrupt() == 130, launcher.output()
    assert all(_gone(pid) for pid in launcher.descendants)
    assert all(_port_free(port) for port in ports), launcher.output()
    logs = re.search(r"logs in (\S+);", launcher.output())
    assert logs and f"logs kept in {logs.group(1)}" in launcher.output()
    assert {"prefill", "decode", "proxy"} <= {p.stem.rstrip("0123456789") for p in Path(logs.group(1)).glob("*.log")}


def _two_free_ports() -> int | None:
    """A free port whose next port is free too, or None."""
    port = free_port()
    return port if _port_free(port + 1) else None


def _proxy_sees(proxy_port: int, num_prefill: int, num_decode: int) -> bool:
    try:
        workers = httpx.get(f"http://127.0.0.1:{proxy_port}/health", timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return False
    return workers["prefill"]["healthy"] >= num_prefill and workers["decode"]["healthy"] >= num_decode


@needs_di
def test_launch_1p1d_serves_then_stops_everything_on_ctrl_c(launch):
    ports = {name: free_port() for name in ("PROXY_PORT", "PREFILL_PORT", "DECODE_PORT", "KV_PORT")}
    launcher = launch(LAUNCH_1P1D, ["--kv-transport", "shm", "--status", "1"], {k: str(v) for k, v in ports.items()})
    _serve_one(launcher, ports["PROXY_PORT"], lambda: "1P1D serving on" in launcher.output())
    # --status 1: a summary of the proxy's GET /status every second, the request just answered in it
    wait_until(lambda: "answers 1 x 200" in launcher.output(), what="a status summary with the answer")
    summary = launcher.output().rsplit("-- neuron-di status", 1)[1]
    assert re.search(rf"prefill +127\.0\.0\.1:{ports['PREFILL_PORT']} +healthy", summary), summary
    assert re.search(rf"decode +127\.0\.0\.1:{ports['DECODE_PORT']} +healthy", summary), summary
    launcher.remember_descendants()
    _interrupt_stops_everything(launcher, list(ports.values()))


@needs_di
def test_launch_xpyd_lets_a_drained_worker_go_serves_on_then_stops_everything_on_ctrl_c(launch):
    ports = {name: free_port() for name in ("PROXY_PORT", "PREFILL_PORT", "KV_PORT", "ETCD_PORT", "ETCD_PEER_PORT")}
    ports["DECODE_PORT"] = wait_until(_two_free_ports, what="two free ports in a row")
    ports["DECODE_PORT_1"] = ports["DECODE_PORT"] + 1  # worker i of a role listens on base port + i
    env = {k: str(v) for k, v in ports.items()}
    launcher = launch(LAUNCH_XPYD, ["--num-prefill", "1", "--num-decode", "2", "--kv-transport", "tcp"], env)
    _serve_one(launcher, ports["PROXY_PORT"],
               lambda: "1P2D serving on" in launcher.output() and _proxy_sees(ports["PROXY_PORT"], 1, 2))
    # Draining one worker, as docs/architecture.md says to take one out without losing a request: it exits 0 and the
    # launcher lets it go; the fleet serves on with the others.
    assert httpx.post(f"http://127.0.0.1:{ports['DECODE_PORT']}/drain", timeout=10).status_code == 202
    wait_until(lambda: "decode0 exited" in launcher.output(), timeout=60, what="the launcher to report the drain")
    assert "decode0 exited after draining (status 0); the other workers keep serving" in launcher.output()
    assert launcher.proc.poll() is None, launcher.output()  # not torn down
    assert not _port_free(ports["DECODE_PORT_1"]) and not _port_free(ports["PROXY_PORT"])
    for _ in range(2):  # round-robin would have picked the drained worker for one of them
        reply = httpx.post(f"http://127.0.0.1:{ports['PROXY_PORT']}/v1/completions", timeout=120, json={
            "model": "neuron-di-builtin", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
    _interrupt_stops_everything(launcher, list(ports.values()))
