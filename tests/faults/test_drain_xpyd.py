"""Draining workers out of a running 2P2D stack over etcd, through proxy_server.py, under load.

One prefill worker gets SIGTERM and one decode worker POST /drain while requests run. Each leaves
etcd within a second, finishes what it had (a prefill worker also serves the KV its decode peers
have not pulled yet) and exits 0; the proxy sends nothing new to them, and every request of the
load succeeds with the output of one `both` worker. The survivors hold no KV block afterwards.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Iterator

import httpx
import pytest

from faults.load import Load, LoadSize, Reference, Tally, prompts
from stack.etcd import EtcdServer
from tests.helpers import wait_until
from tests.proxy.conftest import Server, proxied_2p2d
from tests.proxy.registration import registered_workers
from tests.worker_process import WorkerProcess

# Well under the registration lease's TTL (10 s): the keys go because the lease is revoked, not
# because it expired. (Unloaded, they go within a second.)
LEAVES_ETCD_WITHIN_S = 5.0


def _size(requests: int) -> LoadSize:
    return LoadSize(requests=requests, concurrency=4, deadline_s=120.0)


@pytest.fixture
def stack(etcd_server: EtcdServer) -> Iterator[tuple[Server, list[WorkerProcess]]]:
    flags = ["--etcd", etcd_server.endpoint, "--drain-timeout", "60"]
    with proxied_2p2d(flags, lambda _: ["--etcd", etcd_server.endpoint, "--health-interval", "0.5"]) as (proxy, workers):
        wait_until(lambda: all(_proxy_workers(proxy)[role]["healthy"] == 2 for role in ("prefill", "decode")),
                   timeout=30, what="the proxy discovering the four workers")
        yield proxy, workers


def _proxy_workers(proxy: Server) -> dict[str, dict[str, int]]:
    return httpx.get(f"{proxy.url}/health", timeout=5).json()["workers"]


def _registered_ports(etcd: str) -> set[int]:
    return {record.http_port for record in registered_workers(etcd)}


def _drain_under_load(etcd: EtcdServer, proxy: Server, workers: list[WorkerProcess], requests: int) -> None:
    prefill, _, decode, _ = workers
    drained = {prefill.port, decode.port}
    load = Load(proxy.url, prompts(requests, seed=17, input_len=(20, 300), output_len=(8, 40)), _size(requests))

    async def run() -> float:
        running = asyncio.ensure_future(load.run())
        await load.wait_done(requests // 4, timeout_s=120)
        started = time.monotonic()
        os.kill(prefill.proc.pid, signal.SIGTERM)
        reply = await asyncio.to_thread(httpx.post, f"{decode.url}/drain", timeout=10)
        assert reply.status_code == 202 and reply.json() == {"status": "draining"}
        left = started + LEAVES_ETCD_WITHIN_S - time.monotonic()
        await asyncio.to_thread(wait_until, lambda: not _registered_ports(etcd.endpoint) & drained,
                                timeout=max(left, 0.0), interval=0.02, what="the drained workers' etcd keys gone")
        await running
        return load.done

    with Reference() as reference:
        assert asyncio.run(run()) == requests
        tally = Tally()
        asyncio.run(tally.add_load(load, reference))
    assert tally.ok == requests, (tally.problems, tally.errors)
    for worker in (prefill, decode):
        assert worker.proc.proc.wait(timeout=90) == 0, worker.proc.output()[-3000:]
        assert "drained: nothing left in flight" in worker.proc.output()
    survivors = [w for w in workers if w.port not in drained]
    assert _registered_ports(etcd.endpoint) == {w.port for w in survivors}
    for worker in survivors:
        worker.wait_blocks_free()


def test_draining_a_prefill_and_a_decode_worker_under_load_loses_no_request(
        etcd_server: EtcdServer, stack: tuple[Server, list[WorkerProcess]]) -> None:
    _drain_under_load(etcd_server, *stack, requests=24)


@pytest.mark.slow
def test_draining_under_a_bigger_load_loses_no_request(
        etcd_server: EtcdServer, stack: tuple[Server, list[WorkerProcess]]) -> None:
    _drain_under_load(etcd_server, *stack, requests=120)
