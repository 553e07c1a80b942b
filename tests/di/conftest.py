from __future__ import annotations

from pathlib import Path
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


@pytest.fixture
def blocks_free_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test, every worker it used (the pair, the `both` worker) holds no KV block."""
    yield
    for name in ("pair", "both_worker"):
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            for worker in value if isinstance(value, tuple) else (value,):
                worker.wait_blocks_free()


def write_secret(path: Path, secret: str) -> str:
    """A KV secret file as an operator makes one: private to its user."""
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="session")
def kv_secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_secret(tmp_path_factory.mktemp("kv-secret") / "secret", "the deployment's KV secret")
