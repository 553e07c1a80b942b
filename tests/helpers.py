"""Shared test utilities: free ports, polling with a deadline, and managed subprocesses."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
               what: str = "condition") -> T:
    """Polls `predicate` until it returns a truthy value; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the predicate may fail until the thing is up
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_error!r}")


async def send_and_leave(port: int, path: str, body: dict[str, Any], delay: float = 0.0,
                         until: asyncio.Event | None = None) -> None:
    """A client that sends a whole POST request to 127.0.0.1:`port` and closes the connection
    `delay` seconds later (or once `until` is set) without reading a byte of the answer."""
    payload = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
    await writer.drain()
    if until is not None:
        await until.wait()
    await asyncio.sleep(delay)  # the request's stage when its client leaves
    writer.close()
    await writer.wait_closed()


class ManagedProcess:
    """A child process that is always stopped (SIGTERM, then SIGKILL) when the test ends."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None,
                 cwd: Path | str = ROOT, name: str = "process") -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen(list(args), cwd=cwd, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.log.close()


def python_process(module_args: Sequence[str], name: str, env: dict[str, str] | None = None) -> ManagedProcess:
    """Starts `python <module_args>` from the repo root with the current interpreter."""
    return ManagedProcess([sys.executable, *module_args], env=env, name=name)


def wait_http_ok(url: str, proc: ManagedProcess | None = None, timeout: float = 60.0) -> None:
    """Waits until GET `url` answers 200, failing early (with the log) if `proc` exits."""
    def ready() -> bool:
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.output()[-4000:]}")
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    tail = proc.output()[-4000:] if proc is not None else ""
    raise AssertionError(f"{url} not healthy after {timeout}s\n{tail}")


class EtcdServer:
    """A real etcd with a temp data dir and free ports, on 127.0.0.1 unless `hosts` says where.

    It serves clients on every address of `hosts`: `endpoint` is on the first, and its health is
    probed on the last, which this process must reach. `prefix` runs it through a launcher that
    execs it (e.g. `ip netns exec NAME`).
    """

    def __init__(self, hosts: Sequence[str] = ("127.0.0.1",), prefix: Sequence[str] = ()) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        self.data_dir = tempfile.mkdtemp(prefix="etcd-")
        self.port = free_port()
        peer_url = f"http://{hosts[0]}:{free_port()}"
        self.endpoint = f"{hosts[0]}:{self.port}"
        self.process = ManagedProcess([
            *prefix, binary, "--name", "test", "--data-dir", self.data_dir,
            "--listen-client-urls", ",".join(f"http://{host}:{self.port}" for host in hosts),
            "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"test={peer_url}",
        ], name="etcd")
        try:
            wait_http_ok(f"http://{hosts[-1]}:{self.port}/health", self.process, timeout=20.0)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
