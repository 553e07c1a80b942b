"""Which workers the pool reports lost, and how InFlightLegs ends the legs waiting on one (plain asyncio)."""
from __future__ import annotations

import asyncio

import pytest

from proxy import WorkerPool, WorkerRecord
from proxy.errors import WorkerLost
from proxy.legs import InFlightLegs

A, B = WorkerRecord("prefill", "h", 1), WorkerRecord("decode", "h", 2)


def test_pool_reports_workers_lost_to_health_checks_and_removal_only() -> None:
    lost: list[tuple[str, str]] = []
    pool = WorkerPool([A, B], on_lost=lambda worker, why: lost.append((worker.key, why)))
    pool.mark(A.key, healthy=False)  # a dropped connection or one late answer: other legs may still end well
    pool.mark(A.key, healthy=True)
    pool.lose(A.key, "stopped answering its health checks")
    assert pool.healthy("prefill") == []
    pool.remove(B.key, "its etcd record is gone")
    pool.remove(B.key, "its etcd record is gone")  # not known any more
    pool.replace_all([B], "its etcd record is gone")
    assert lost == [(A.key, "stopped answering its health checks"), (B.key, "its etcd record is gone"),
                    (A.key, "its etcd record is gone")]


def test_ending_a_workers_legs_fails_them_with_worker_lost_and_leaves_others() -> None:
    async def run() -> None:
        legs, never = InFlightLegs(), asyncio.Event()

        async def leg(worker: WorkerRecord) -> None:
            with legs.leg(worker):
                await never.wait()
        to_a, to_b, also_a = (asyncio.ensure_future(leg(w)) for w in (A, B, A))
        await asyncio.sleep(0)  # each task enters its leg
        assert legs.end(A, "stopped answering its health checks") == 2
        for task in (to_a, also_a):
            with pytest.raises(WorkerLost, match=r"^prefill worker h:1: stopped answering its health checks$"):
                await task
        assert not to_b.done() and legs.end(A, "again") == 0
        to_b.cancel()  # any other cancellation stays one
        with pytest.raises(asyncio.CancelledError):
            await to_b
    asyncio.run(run())
