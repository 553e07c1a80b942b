"""The planner flips a real decode worker to prefill when prompts grow long, under load, losing nothing.

Three of our workers (the built-in model, one thread each: 1 prefill, 2 decode) register in a real
etcd behind the proxy; `python -m planner --connector flip` watches them. Short prompts keep the split;
long ones overload the one prefill worker, and the planner flips a decode worker to prefill while the
load runs. Every request succeeds with the output of one `both` worker, and every worker's KV blocks
are free afterwards. The planner is then killed and started again: it takes over the running fleet
(nothing restarts, nothing changes while the load is steady).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from faults.load import Load, LoadSize, Reference, Tally, prompts
from stack.etcd import EtcdServer
from stack.serving import Process
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.proxy.registration import registered_workers
from tests.worker_process import WorkerProcess, start_workers, stop_together

PLANNER_FLAGS = ["--ttft-target-ms", "400", "--itl-target-ms", "200", "--budget", "3", "--connector", "flip",
                 "--interval", "1", "--cooldown", "4", "--min-samples", "1", "--scale-down-after", "1000"]


@pytest.fixture
def fleet(etcd_server: EtcdServer) -> Iterator[tuple[Server, list[WorkerProcess]]]:
    flags = ["--etcd", etcd_server.endpoint, "--drain-timeout", "30", "--etcd-ttl", "3"]
    workers: list[WorkerProcess] = []
    proxy = None
    try:
        workers = start_workers(*((role, "shm", flags) for role in ("prefill", "decode", "decode")))
        proxy = start_proxy(["--etcd", etcd_server.endpoint, "--health-interval", "0.5"])
        wait_until(lambda: _healthy(proxy) == {"prefill": 1, "decode": 2}, timeout=30, what="the proxy seeing 1P2D")
        yield proxy, workers
    finally:
        stop_together(proxy.process if proxy is not None else None, *workers)


def _healthy(proxy: Server) -> dict[str, int]:
    counts = httpx.get(f"{proxy.url}/health", timeout=5).json()["workers"]
    return {role: counts[role]["healthy"] for role in ("prefill", "decode")}


def _roles(etcd: str) -> dict[str, int]:
    records = registered_workers(etcd)
    return {role: sum(r.role == role for r in records) for role in ("prefill", "decode")}


def _planner(etcd: str, proxy: Server, decisions: Path) -> Process:
    return Process("planner", ["-m", "planner", "--etcd", etcd, "--proxy-url", proxy.url, *PLANNER_FLAGS,
                               "--decisions", str(decisions), "--state-file", str(decisions.with_suffix(".state"))])


def test_the_planner_flips_a_decode_worker_to_prefill_under_load(
        etcd_server: EtcdServer, fleet: tuple[Server, list[WorkerProcess]], tmp_path: Path) -> None:
    proxy, workers = fleet
    decisions = tmp_path / "decisions.jsonl"
    planner = _planner(etcd_server.endpoint, proxy, decisions)
    short = prompts(24, seed=3, input_len=(10, 40), output_len=(4, 12))
    long = prompts(32, seed=4, input_len=(1500, 1900), output_len=(2, 6))  # the flip came after 7 of them
    size = LoadSize(requests=len(long), concurrency=4, deadline_s=120.0)
    try:
        short_load = Load(proxy.url, short, LoadSize(len(short), 3))
        asyncio.run(short_load.run())
        assert _roles(etcd_server.endpoint) == {"prefill": 1, "decode": 2}
        long_load = Load(proxy.url, long, size)

        async def run() -> None:
            running = asyncio.ensure_future(long_load.run())
            await asyncio.to_thread(wait_until, lambda: _roles(etcd_server.endpoint) == {"prefill": 2, "decode": 1},
                                    timeout=90, interval=0.2, what="a decode worker flipped to prefill")
            await running
        asyncio.run(run())
        changes = [json.loads(line) for line in decisions.read_text().splitlines() if json.loads(line)["changed"]]
        assert [(c["target_prefill"], c["target_decode"]) for c in changes] == [(2, 1)], changes
        # Killed and started again: it takes over the fleet as it is, and changes nothing while nothing changes.
        planner.kill()
        planner.stop()   # it is dead already: this only removes its log
        pids = [w.proc.pid for w in workers]
        before = decisions.read_text().count("\n")
        planner = _planner(etcd_server.endpoint, proxy, decisions)
        wait_until(lambda: decisions.read_text().count("\n") >= before + 3, timeout=30, what="three new intervals")
        assert all(w.proc.proc.poll() is None for w in workers) and [w.proc.pid for w in workers] == pids
        assert _roles(etcd_server.endpoint) == {"prefill": 2, "decode": 1}
        _check_bad_role_requests(workers[0].url)
        with Reference() as reference:
            tally = Tally()
            asyncio.run(tally.add_load(short_load, reference))
            asyncio.run(tally.add_load(long_load, reference))
        assert tally.ok == len(short) + len(long), (tally.problems, tally.errors)
        for worker in workers:
            worker.wait_blocks_free()
    finally:
        planner.stop()
        print(planner.output()[-4000:])


def _check_bad_role_requests(url: str) -> None:
    """POST /role refuses what a worker cannot do, naming `role`, and answers `unchanged` for its own role."""
    for payload in ({"role": "encode"}, {}):
        reply = httpx.post(f"{url}/role", json=payload, timeout=10)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "role", reply.text
        assert "`role` must be one of ['prefill', 'decode']" in reply.json()["error"]["message"]
    reply = httpx.post(f"{url}/role", json={"role": "prefill"}, timeout=10)
    assert reply.status_code == 200 and reply.json() == {"status": "unchanged", "role": "prefill"}
