"""A prefill worker that freezes (SIGSTOP: its connections stay open, nothing answers) while requests
are in flight to it, through proxy_server.py to a real 1P1D pair: the health checks find it dead within
a few intervals, and every request waiting on it ends then with a clear error, not after the proxy's
600 s read timeout. Thawed, the worker serves exact answers again and both workers free every block."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Iterator

import httpx
import pytest

from proxy.discovery import LOST_AFTER_FAILED_CHECKS
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers

HEALTH_INTERVAL = 1.0
# A worker is lost after LOST_AFTER_FAILED_CHECKS silent health rounds, each an interval apart and
# failing after its timeout (one interval): twice that covers a loaded 2-core machine, and stays far
# below the read timeout.
ENDED_WITHIN_S = 2 * (LOST_AFTER_FAILED_CHECKS + 1) * 2 * HEALTH_INTERVAL
BODY = {"model": "neuron-di-builtin", "prompt": "def fibonacci(n):\n    " * 12, "temperature": 0.0}
PREFILL_ONLY = {**BODY, "max_tokens": 1}
STREAMED = {**BODY, "max_tokens": 8, "stream": True}
EACH = 3  # requests of each kind
BUSY = {**BODY, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture
def stack() -> Iterator[tuple[Server, WorkerProcess, WorkerProcess]]:
    started: list[WorkerProcess] = []
    proxy: Server | None = None
    try:
        # One sequence at a time: a long request sent to the prefill worker itself keeps the others waiting.
        started = start_workers(("prefill", "shm", ["--max-num-seqs", "1"]), ("decode", "shm", ()))
        prefill, decode = started
        proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                             "--prefill-kv-port", str(prefill.kv_port),
                             "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
                             "--health-interval", str(HEALTH_INTERVAL), "--health-timeout", str(HEALTH_INTERVAL),
                             "--read-timeout", "600"])
        yield proxy, prefill, decode
    finally:
        if proxy is not None:
            proxy.process.stop()
        for worker in started:
            os.kill(worker.proc.pid, signal.SIGCONT)  # a frozen worker cannot stop
            worker.stop()


async def outcome(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str]:
    """(HTTP status, the error's message; a whole answer's text for a 200)."""
    reply = await client.post(f"{url}/v1/completions", json=body)
    return reply.status_code, reply.text if reply.status_code == 200 else reply.json()["error"]["message"]


def test_requests_waiting_on_a_frozen_prefill_worker_end_with_a_clear_error(stack) -> None:
    proxy, prefill, decode = stack
    exact = httpx.post(f"{proxy.url}/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60).json()
    lost = (f"prefill worker 127.0.0.1:{prefill.port}: stopped answering its health checks "
            f"({LOST_AFTER_FAILED_CHECKS} in a row)")

    async def run() -> tuple[list[tuple[int, str]], float]:
        async with httpx.AsyncClient(timeout=600) as client:
            busy = asyncio.ensure_future(client.post(f"{prefill.url}/v1/completions", json=BUSY))
            await asyncio.to_thread(wait_until, lambda: prefill.metric("neuron_di_requests_running") == 1,
                                    timeout=60, what="the prefill worker busy")
            sent = [asyncio.ensure_future(outcome(client, proxy.url, body))
                    for _ in range(EACH) for body in (PREFILL_ONLY, STREAMED)]
            await asyncio.to_thread(wait_until, lambda: prefill.metric("neuron_di_requests_waiting") == 2 * EACH,
                                    timeout=60, what="the prefill worker to queue every request")
            os.kill(prefill.proc.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*sent), timeout=60), time.monotonic() - frozen
            os.kill(prefill.proc.pid, signal.SIGCONT)
            assert (await busy).status_code == 200  # the worker's own request only waited
            return outcomes
    try:
        outcomes, took = asyncio.run(run())
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    # Before the first token, so a status, not an SSE error event. Prefill-only requests end when the health
    # checks find the worker lost; a disaggregated one may end first through its decode worker, whose pull fails
    # once the frozen peer's connection times out, naming that peer.
    peer_lost = f"the connection to prefill peer 127.0.0.1:{prefill.kv_port} was lost"
    assert outcomes[0::2] == [(502, lost)] * EACH, outcomes
    assert all(o == (502, lost) or (o[0] == 503 and peer_lost in o[1]) for o in outcomes[1::2]), outcomes
    assert took <= ENDED_WITHIN_S, f"the requests ended {took:.1f} s after the prefill worker froze"

    wait_until(lambda: httpx.get(f"{proxy.url}/ready", timeout=5).status_code == 200, timeout=30,
               what="the thawed prefill worker back in rotation")
    again = httpx.post(f"{proxy.url}/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60).json()
    assert again["choices"][0]["text"] == exact["choices"][0]["text"]
    prefill.wait_blocks_free()
    decode.wait_blocks_free()
