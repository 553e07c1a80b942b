"""Dozens of simulated workers on two cores: 24 mock workers (12 prefill, 12 decode) registered in etcd
behind the proxy serve a load exactly as one mock `both` worker would, and hold no KV block afterwards."""
from __future__ import annotations

import asyncio
from typing import Iterator

import httpx
import pytest

from faults.load import Load, LoadSize, Tally, body, prompts
from stack.etcd import EtcdServer
from stack.serving import Process, free_port, wait_healthy
from stack.worker_fleet import start_workers, stop_workers
from stack.worker_metrics import wait_blocks_free
from tests.helpers import wait_until

MOCK = ["--engine", "mock", "--threads", "1", "--kv-transport", "shm", "--etcd-ttl", "5"]
SIZE = 24


@pytest.fixture
def fleet(etcd_server: EtcdServer) -> Iterator[tuple[str, str, dict[str, str]]]:
    def mock(i: int, port: int, kv_port: int) -> tuple[str, list[str]]:
        role = "prefill" if i < SIZE // 2 else "decode" if i < SIZE else "both"
        if role == "both":
            return "mock-both", ["-m", "worker", "--port", str(port), *MOCK]
        return f"mock-{role}-{i}", ["-m", "worker", "--role", role, "--port", str(port), "--kv-port", str(kv_port),
                                    "--etcd", etcd_server.endpoint, *MOCK]

    workers = start_workers(SIZE + 1, mock, timeout_s=300)
    urls = {f"{'prefill' if i < SIZE // 2 else 'decode'}-{i}": url for i, (_, url) in enumerate(workers[:SIZE])}
    proxy: Process | None = None
    try:
        port = free_port()
        proxy = Process("proxy", ["proxy_server.py", "--port", str(port), "--etcd", etcd_server.endpoint])
        proxy_url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{proxy_url}/health", [proxy], 60)
        wait_until(lambda: httpx.get(f"{proxy_url}/health", timeout=5).json()["workers"]["decode"]["healthy"] == SIZE // 2,
                   timeout=60, what="the proxy discovering the fleet")
        yield proxy_url, workers[SIZE][1], urls
    finally:
        if proxy is not None:
            proxy.stop()
        stop_workers(workers)


@pytest.mark.slow
def test_two_dozen_mock_workers_serve_as_one(fleet: tuple[str, str, dict[str, str]]) -> None:
    proxy, both, workers = fleet
    requests = prompts(96, seed=5, input_len=(10, 600), output_len=(4, 32))
    load = Load(proxy, requests, LoadSize(len(requests), 12))
    asyncio.run(load.run())
    wants = [httpx.post(f"{both}/v1/completions", json=body(r, False), timeout=60).json()["choices"][0]["text"]
             for r in requests]
    tally = Tally()
    for outcome, want in zip(load.outcomes, wants):
        assert outcome is not None
        tally.add(outcome, want)
    assert tally.ok == len(requests), (tally.problems, tally.errors)
    assert not any(wait_blocks_free(workers, 30).values())
