"""--routing least_loaded: the pick, and real (simulated-engine) workers: while one prefill worker computes a long
prompt, the short requests sent behind it go to the other (round-robin sends every second one to wait for it)."""
from __future__ import annotations

import asyncio

import httpx

from benchmarks.serving_load import SyntheticRequest
from faults.load import body
from stack.serving import Process, free_port, wait_healthy
from stack.worker_fleet import start_workers, stop_workers
from stack.worker_metrics import metric_sum, wait_blocks_free
from proxy.workers import WorkerPool, WorkerRecord, pick
from tests.helpers import wait_until

# Prefill at 400 tokens/s: the long prompt holds its worker 3 s, a short one a few milliseconds.
MOCK = ["--engine", "mock", "--threads", "1", "--kv-transport", "shm", "--mock-prefill-tokens-per-s", "400"]
LONG = [10 + i % 200 for i in range(1200)]
SHORT = list(range(10, 20))
PROMPT_TOKENS = "neuron_di_prompt_tokens_total"


def test_the_pick_takes_the_worker_with_fewest_legs_in_flight_in_turn_among_equals() -> None:
    workers = [WorkerRecord("prefill", "h", port) for port in (1, 2, 3)]
    assert [pick(workers, t, [2, 0, 0]).http_port for t in range(4)] == [2, 2, 3, 2]
    in_flight = {1: 2, 2: 0, 3: 0}
    pool = WorkerPool([*workers, WorkerRecord("decode", "h", 4)], legs=lambda w: in_flight[w.http_port])
    picked = []
    for _ in range(4):   # each pick is a leg in flight: the first worker's backlog gets none until all are even
        worker = pool.next("prefill")
        in_flight[worker.http_port] += 1
        picked.append(worker.http_port)
    assert picked == [2, 3, 3, 2] and in_flight == {1: 2, 2: 2, 3: 2}
    assert [pool.next("prefill").http_port for _ in range(3)] == [2, 3, 1]   # all even: in turn


async def _long_then_shorts(proxy: str, prefills: list[str]) -> tuple[list[int], bool]:
    """The prompt tokens each prefill worker received for one long request and four short ones sent one after
    the other once the long one reached its worker; and whether the short ones were answered before it."""
    async with httpx.AsyncClient(timeout=60) as client:
        def ask(prompt: list[int]) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(client.post(f"{proxy}/v1/completions",
                                                   json=body(SyntheticRequest(prompt, 2), stream=False)))
        long = ask(LONG)

        def reached() -> bool:
            assert not long.done(), long.result().text
            return sum(metric_sum(url, PROMPT_TOKENS) for url in prefills) > 0
        await asyncio.to_thread(wait_until, reached, timeout=30, what="the long prompt reaching a prefill worker")
        shorts = [await ask(SHORT) for _ in range(4)]
        first = not long.done()
        answers = [await long, *shorts]
    assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
    return [metric_sum(url, PROMPT_TOKENS) for url in prefills], first


def test_short_requests_do_not_wait_behind_a_long_prompt() -> None:
    def mock(i: int, port: int, kv_port: int) -> tuple[str, list[str]]:
        role = ("prefill", "prefill", "decode")[i]
        return f"mock-{role}-{i}", ["-m", "worker", "--role", role, "--port", str(port), "--kv-port", str(kv_port),
                                    *MOCK]
    workers = start_workers(3, mock)
    urls = [url for _, url in workers]
    proxy = None
    try:
        port = free_port()
        proxy = Process("proxy", ["proxy_server.py", "--port", str(port), "--routing", "least_loaded",
                                  *(f"--prefill={url.removeprefix('http://')}" for url in urls[:2]),
                                  f"--decode={urls[2].removeprefix('http://')}"])
        wait_healthy(f"http://127.0.0.1:{port}/health", [proxy], 60)
        tokens, shorts_first = asyncio.run(_long_then_shorts(f"http://127.0.0.1:{port}", urls[:2]))
        assert shorts_first
        assert sorted(tokens) == [4 * len(SHORT), len(LONG)], tokens
        assert not any(wait_blocks_free({str(i): url for i, url in enumerate(urls)}, 30).values())
    finally:
        if proxy is not None:
            proxy.stop()
        stop_workers(workers)
