"""Clients at the worker's HTTP edge, a real worker process behind hypercorn: one that closes its
connection right after sending has its request aborted, not generated to the end for nobody (as the
proxy's cancelled legs meet it); one that sends a body over the size limit reads a 413."""
from __future__ import annotations

import asyncio
from typing import Iterator

import httpx
import pytest

from tests.body_limit import assert_clients_see_413
from tests.helpers import send_and_leave
from tests.worker_process import WorkerProcess

BODY = {"model": "neuron-di-builtin", "prompt": "def fibonacci(n):\n    " * 12, "max_tokens": 400,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    worker = WorkerProcess()
    try:
        yield worker
    finally:
        worker.stop()


def test_clients_closing_right_after_sending_have_their_requests_aborted(worker: WorkerProcess) -> None:
    async def run() -> None:
        for _ in range(20):  # one by one, each meeting a server that is not busy reading another
            await send_and_leave(worker.port, "/v1/completions", BODY)
            await asyncio.sleep(0.05)
    asyncio.run(run())
    # A request left running holds its blocks for its 400 tokens, seconds on this machine; an aborted
    # one frees them at the engine's next step (the half second over 1 s covers polling /metrics).
    worker.wait_blocks_free(timeout=1.5)
    assert 'outcome="length"' not in httpx.get(f"{worker.url}/metrics", timeout=10).text  # none ran to its end


def test_a_body_over_the_limit_is_a_413_clients_read_and_the_worker_keeps_serving(worker: WorkerProcess) -> None:
    assert_clients_see_413(worker.url)
    reply = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
