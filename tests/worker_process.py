"""The one way tests start a worker: `python -m worker` on free ports, stopped with its children."""
from __future__ import annotations

import re
from typing import Sequence

import httpx

from stack.serving import (Process, StackError, StackOptions, free_port, port_was_taken, stop_all, wait_healthy,
                           worker_args)
from tests.helpers import wait_until

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class WorkerProcess:
    """`python -m worker --role ROLE` (the command line stack/serving.py builds) on free ports.

    `wait=False` only launches it (see `start_workers`); `wait_ready()` then waits for its GET /health."""

    def __init__(self, role: str = "both", transport: str = "shm", extra: Sequence[str] = (),
                 port: int | None = None, kv_port: int | None = None, wait: bool = True) -> None:
        self.role, self.transport, self.extra = role, transport, tuple(extra)
        self._fixed_port, self._fixed_kv_port = port, kv_port
        self._launch()
        if wait:
            self.wait_ready()

    def _launch(self) -> None:
        self.port = self._fixed_port or free_port()
        self.kv_port = (self._fixed_kv_port if self._fixed_kv_port is not None
                        else free_port() if self.role == "prefill" else 0)
        self.url = f"http://127.0.0.1:{self.port}"
        args = worker_args(self.role, self.port, StackOptions(kv_transport=self.transport),
                           self.kv_port if self.role != "both" else None)
        self.proc: Process = Process(f"{self.role}-worker", [*args, *self.extra], env=WORKER_ENV)

    def wait_ready(self) -> None:
        """Waits until the worker answers GET /health; stops it if it does not."""
        # Ports picked here are free only when picked: one another process took first is picked again.
        attempts = 3 if self._fixed_port is None and self._fixed_kv_port is None else 1
        for attempt in range(1, attempts + 1):
            try:
                wait_healthy(f"{self.url}/health", [self.proc], 120.0)
                return
            except StackError as exc:
                self.proc.stop()
                if not port_was_taken(exc) or attempt == attempts:
                    raise
                self._launch()
            except BaseException:
                self.proc.stop()
                raise

    @property
    def engine_id(self) -> str:
        """This worker's signal-plane engine id, as its GET /health shows it."""
        return httpx.get(f"{self.url}/health", timeout=10.0).json()["worker"]["engine_id"]

    def metric(self, name: str) -> int:
        """A gauge of this worker, read from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        assert match is not None, text
        return int(float(match.group(1)))

    def blocks_used(self) -> int:
        return self.metric("neuron_di_kv_blocks_used")

    def wait_blocks_free(self, timeout: float = 30.0) -> None:
        wait_until(lambda: self.blocks_used() == 0, timeout=timeout)

    def restarted(self) -> WorkerProcess:
        """The same worker (role, ports, flags) started anew; call after this one died (its log is removed)."""
        self.stop()
        return WorkerProcess(self.role, self.transport, self.extra, self.port, self.kv_port)

    def stop(self) -> None:
        self.proc.stop()


def start_workers(*specs: tuple[str, str, Sequence[str]]) -> list[WorkerProcess]:
    """Workers (role, transport, extra flags) launched at once, then waited for: a start is mostly one core's
    imports, so on two cores a pair is ready in about the time of one. All are stopped if one fails."""
    workers: list[WorkerProcess] = []
    try:
        for role, transport, extra in specs:
            workers.append(WorkerProcess(role, transport, extra, wait=False))
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        stop_together(*workers)
        raise
    return workers


def stop_together(*items: WorkerProcess | Process | None) -> None:
    """Stops workers and other processes (a proxy's `.process`) at once; None items are skipped."""
    stop_all([item.proc if isinstance(item, WorkerProcess) else item for item in items if item is not None])
