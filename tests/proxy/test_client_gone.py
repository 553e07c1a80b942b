"""Clients that leave early, through proxy_server.py to a real prefill + decode pair: both legs are
cancelled whatever the request's stage, and every KV block is free again at once (the prefill's
abort timeout is 60 s, so nothing here is freed by it)."""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import pytest

from tests.helpers import send_and_leave, wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together

# Long enough that a leg nobody cancelled would still run when the checks below are done.
BODY = {"model": "neuron-di-builtin", "prompt": "def fibonacci(n):\n    " * 12, "max_tokens": 400,
        "temperature": 0.0, "ignore_eos": True}
# The target is 1 s after the last client left; the half second more covers reading /metrics over
# HTTP every 50 ms from a third process on a 2-core machine.
FREE_WITHIN_S = 1.5


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, WorkerProcess, WorkerProcess]]:
    started: list[WorkerProcess] = []
    proxy: Server | None = None
    try:
        started = start_workers(("prefill", "shm", ()), ("decode", "shm", ()))
        prefill, decode = started
        proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                             "--prefill-kv-port", str(prefill.kv_port),
                             "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port)])
        yield proxy, prefill, decode
    finally:
        stop_together(proxy.process if proxy is not None else None, *started)


async def abandon_stream(client: httpx.AsyncClient, url: str, chunks: int) -> None:
    """A client that reads `chunks` events of a streamed answer, then closes the connection."""
    async with client.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}) as reply:
        assert reply.status_code == 200
        seen = 0
        async for line in reply.aiter_lines():
            seen += line.startswith("data: ")
            if seen == chunks:
                return
    raise AssertionError(f"the stream ended before {chunks} events")


def test_clients_leaving_early_cancel_both_legs_and_free_every_block(stack) -> None:
    proxy, prefill, decode = stack

    async def run() -> None:
        # 20 clients close right after sending, 10 a little later (while prefill runs, or decode
        # pulls): all before the first byte of a 400-token answer. 10 abandon a stream.
        right_away = [send_and_leave(proxy.port, "/v1/completions", BODY) for _ in range(20)]
        later = [send_and_leave(proxy.port, "/v1/completions", BODY, delay=0.01 * i) for i in range(1, 11)]
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*right_away, *later, *(abandon_stream(client, proxy.url, 1 + i % 3) for i in range(10)))
    asyncio.run(run())
    wait_until(lambda: prefill.blocks_used() == decode.blocks_used() == 0, timeout=FREE_WITHIN_S,
               what="both workers to free every block")
    for worker in (prefill, decode):
        assert worker.metric("neuron_di_requests_running") == worker.metric("neuron_di_requests_waiting") == 0
    tokens = decode.metric("neuron_di_generation_tokens_total")
    time.sleep(0.5)  # an observation window, not a wait: nothing may generate any more
    assert decode.metric("neuron_di_generation_tokens_total") == tokens


def test_fifty_clients_closing_before_the_first_byte_leave_no_generated_tokens(stack) -> None:
    """Nobody reads a byte, so nothing beyond one engine step per request may be generated, and
    both workers free every block within the target."""
    proxy, prefill, decode = stack
    before = decode.metric("neuron_di_generation_tokens_total")

    async def run() -> None:
        await asyncio.gather(*(send_and_leave(proxy.port, "/v1/completions", {**BODY, "stream": i % 2 == 0})
                               for i in range(50)))
    asyncio.run(run())
    left = time.monotonic()
    wait_until(lambda: prefill.blocks_used() == decode.blocks_used() == 0, timeout=30,
               what="both workers to free every block")
    freed_after = time.monotonic() - left
    assert freed_after <= FREE_WITHIN_S, f"blocks freed {freed_after:.2f} s after the last client left"
    generated = decode.metric("neuron_di_generation_tokens_total") - before
    # One step of a request that was already running when its abort arrived adds one token.
    assert generated <= 50, f"the decode worker generated {generated} tokens nobody read"
