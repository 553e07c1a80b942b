from __future__ import annotations

from typing import Iterator

import pytest

from tests.di.workers import worker_pair
from tests.worker_process import WorkerProcess


@pytest.fixture(scope="session")
def both_worker() -> Iterator[WorkerProcess]:
    worker = WorkerProcess("both")
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="session", params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """A prefill and a decode worker (separate processes) over one transport."""
    with worker_pair(request.param) as workers:
        yield workers
