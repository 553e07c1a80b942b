"""Which workers the pool reports lost, which the health checks keep out of rotation, and how InFlightLegs
ends the legs waiting on one (plain asyncio)."""
from __future__ import annotations

import asyncio
import json

import pytest

from proxy import WorkerPool, WorkerRecord
from proxy.discovery import HealthChecks
from proxy.errors import UpstreamUnavailable, WorkerLost
from proxy.legs import InFlightLegs
from proxy.upstream import Reply

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


class _HealthAnswers:
    """An in-memory twin of a worker's client, for GET /health only: `answers[key]` is the reply, None is silence."""

    def __init__(self, answers: dict[str, Reply | None], worker: WorkerRecord) -> None:
        self._answers, self._key = answers, worker.key

    async def get(self, path: str, timeout: float) -> Reply:
        reply = self._answers[self._key]
        if reply is None:
            raise UpstreamUnavailable("connection refused")
        return reply


def test_draining_and_retired_workers_leave_rotation_and_keep_their_legs_until_they_stop_answering() -> None:
    ok, draining = Reply(200, b'{"status":"ok","draining":false}'), Reply(200, b'{"status":"draining","draining":true}')
    lost: list[tuple[str, str]] = []
    pool = WorkerPool([A, B], on_lost=lambda worker, why: lost.append((worker.key, why)))
    answers: dict[str, Reply | None] = {A.key: ok, B.key: draining}
    checks = HealthChecks(pool, lambda worker: _HealthAnswers(answers, worker), timeout=1.0)  # type: ignore[arg-type]

    asyncio.run(checks.round())
    assert pool.healthy("decode") == [] and pool.healthy("prefill") == [A] and lost == []
    answers[B.key] = ok  # a worker that drains no more (e.g. started anew) is back in rotation
    asyncio.run(checks.round())
    assert pool.healthy("decode") == [B]

    pool.retire(A.key)  # its etcd record went
    assert pool.healthy("prefill") == [] and pool.retired(A.key)
    assert not pool.mark(A.key, healthy=True)
    asyncio.run(checks.round())  # still answering: it drains, its legs run on
    assert pool.healthy("prefill") == [] and A in pool.all() and lost == []
    answers[A.key] = None
    asyncio.run(checks.round())
    assert A not in pool.all() and lost == [(A.key, "its etcd record is gone and it stopped answering")]
    pool.add(A)  # registered anew
    assert pool.healthy("prefill") == [A] and not pool.retired(A.key)


def test_a_retired_worker_found_serving_the_other_role_leaves_the_pool_without_ending_its_legs() -> None:
    # A role flip ends the old role's requests first: a leg still in flight to it never reached the old engine,
    # and the new one refuses it (503), which sends it on. Ended with WorkerLost, its request would fail.
    lost: list[tuple[str, str]] = []
    pool = WorkerPool([A, B], on_lost=lambda worker, why: lost.append((worker.key, why)))
    now_decode = WorkerRecord("decode", A.host, A.http_port)
    answers: dict[str, Reply | None] = {A.key: Reply(200, json.dumps({"status": "ok", "draining": False,
                                                                        "worker": now_decode.to_dict()}).encode()),
                                        B.key: Reply(200, b'{"status":"ok","draining":false}')}
    checks = HealthChecks(pool, lambda worker: _HealthAnswers(answers, worker), timeout=1.0)  # type: ignore[arg-type]
    pool.retire(A.key)   # it left etcd to change role
    asyncio.run(checks.round())
    assert A not in pool.all() and lost == []
