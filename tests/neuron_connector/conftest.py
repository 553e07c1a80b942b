from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import torch

from neuron_connector import RecvBuffer, SendBuffer
from tests.neuron_connector.kv import LAYOUT, engine_with_pool


_OUR_THREADS = ("kv-send-", "kv-recv-", "etcd-keepalive")


def _our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(_OUR_THREADS))


def _shm_segments_of_this_process() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if f"-{os.getpid()}-" in name}


@pytest.fixture(autouse=True)
def nothing_leaks() -> Iterator[None]:
    """Every buffer thread, registration thread and shm pool is gone after each test."""
    threads, segments = _our_threads(), _shm_segments_of_this_process()
    yield
    assert _our_threads() == threads, "a connector thread outlived its test"
    assert _shm_segments_of_this_process() <= segments, "an shm pool outlived its test"


@dataclass
class Pair:
    """A prefill SendBuffer and a decode RecvBuffer in this process, over real sockets."""

    send: SendBuffer
    recv: RecvBuffer
    p_pool: torch.Tensor
    d_pool: torch.Tensor
    engines: list[Any]
    released: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)                  # RecvBuffer's on_finished calls
    transfers: list[tuple[float, int]] = field(default_factory=list)   # (seconds, blocks) per push
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_release(self, request_id: str) -> None:
        with self._lock:
            self.released.append(request_id)

    def on_finished(self, request_id: str) -> None:
        with self._lock:
            self.finished.append(request_id)

    def finishes(self) -> list[str]:
        with self._lock:
            return list(self.finished)

    def on_transfer(self, seconds: float, num_blocks: int) -> None:
        with self._lock:
            self.transfers.append((seconds, num_blocks))

    def releases(self) -> list[str]:
        with self._lock:
            return list(self.released)


def make_pair(backend: str = "shm", abort_timeout: float = 60.0, grace: float = 2.0,
              integrity_check: bool = True, p_engine: Any = None,
              p_secret: bytes | None = None, d_secret: bytes | None = None) -> Pair:
    """Prefill engine "prefill-0" and decode engine "decode-0", not started. `p_engine`: the
    prefill's transfer engine, without a pool yet (default: a real one of `backend`)."""
    p_engine, p_pool = engine_with_pool(backend, seed=1, engine=p_engine)
    d_engine, d_pool = engine_with_pool(backend)
    pair = Pair(None, None, p_pool, d_pool, [p_engine, d_engine])  # type: ignore[arg-type]
    pair.send = SendBuffer(p_engine, LAYOUT, "prefill-0", "127.0.0.1", 0, pair.on_release,
                           abort_timeout=abort_timeout, on_transfer=pair.on_transfer, secret=p_secret)
    pair.recv = RecvBuffer(d_engine, LAYOUT, engine_id="decode-0", default_timeout=10.0, grace=grace,
                           on_finished=pair.on_finished, integrity_check=integrity_check, secret=d_secret)
    return pair


def close_pair(pair: Pair) -> None:
    pair.recv.close()
    pair.send.close()
    for engine in pair.engines:
        engine.close()


@contextmanager
def running_pair(backend: str = "shm", **options: Any) -> Iterator[Pair]:
    """A started `make_pair(backend, **options)`, closed on exit."""
    pair = make_pair(backend, **options)
    pair.send.start()
    pair.recv.start()
    try:
        yield pair
    finally:
        close_pair(pair)


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    with running_pair(request.param) as p:
        yield p


@pytest.fixture
def shm_pair() -> Iterator[Pair]:
    with running_pair("shm", abort_timeout=1.0) as p:
        yield p
