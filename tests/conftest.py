from __future__ import annotations

import socket
from typing import Iterator

import pytest

from stack.etcd import EtcdServer
from stack.serving import Process
from tests import warm_start


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", help="also run the slow load/soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="slow: run with --full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def warm_starts() -> Iterator[None]:
    """Our workers, proxies and planners start warm for the whole session (see tests/warm_start.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Process, "_start", warm_start.start)
        yield


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another server listens on (as when another process took a picked port first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]
