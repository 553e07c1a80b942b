from __future__ import annotations

from typing import Iterator

import pytest

from tests.di.workers import Worker, worker_pair


@pytest.fixture(scope="session")
def both_worker() -> Iterator[Worker]:
    worker = Worker("both")
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="session", params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker (separate processes) over one transport."""
    with worker_pair(request.param) as workers:
        yield workers
