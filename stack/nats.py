"""A real nats-server with JetStream on free loopback ports, its store in a temporary directory: for the
global prefill queue's tests and benchmarks."""
from __future__ import annotations

import shutil
import tempfile

from stack.serving import Process, StackError, free_port, wait_healthy


def nats_binary() -> str:
    binary = shutil.which("nats-server")
    if binary is None:
        raise StackError("nats-server is not on PATH (Debian: apt-get install nats-server)")
    return binary


class NatsServer:
    """A started nats-server -js on 127.0.0.1; `url` is its client URL. `kill()` ends it at once (SIGKILL) and
    `restart()` starts it again on the same port and store, as after a crash; `stop()` ends it and removes
    its store."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        self.store_dir = tempfile.mkdtemp(prefix="neuron-di-nats-")
        self.port, self.monitor_port = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._timeout_s = timeout_s
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        args = ["-js", "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
                "-sd", self.store_dir, "--server_name", "neuron-di-test"]
        self.process = Process("nats-server", args, program=nats_binary())
        wait_healthy(f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true", [self.process],
                     self._timeout_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.stop()

    def restart(self) -> None:
        self._start()

    def stop(self) -> None:
        if hasattr(self, "process"):
            self.process.stop()
        shutil.rmtree(self.store_dir, ignore_errors=True)
