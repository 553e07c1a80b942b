"""Resending a request whose leg was lost before it answered (proxy/resend.py), driven by hand: a plain
worker pool, attempts that fail as lost legs do, and a health probe answered in memory."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.errors import UpstreamError, UpstreamStatus, UpstreamUnavailable, WorkerLost
from proxy.resend import LegResender
from proxy.upstream import Reply
from proxy.workers import WorkerPool, WorkerRecord

P0, P1 = WorkerRecord("prefill", "127.0.0.1", 8100), WorkerRecord("prefill", "127.0.0.1", 8101)
D0, D1 = WorkerRecord("decode", "127.0.0.1", 8200), WorkerRecord("decode", "127.0.0.1", 8201)


class Probe:
    """GET /health of a prefill worker: 200, or the worker is gone."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    async def get(self, path: str, timeout: float) -> Reply:
        if not self.alive:
            raise UpstreamUnavailable("connection refused", "prefill", P0.address, refused=True)
        return Reply(200, b"{}")


def _run(limit: int, failures: list[UpstreamError], alive: bool = True) -> tuple[list[tuple[str, str]], Any]:
    """The (prefill, decode) address pairs the attempts went to, and the answer or the error raised."""
    pool = WorkerPool([P0, P1, D0, D1])
    resender = LegResender(pool, lambda worker: Probe(alive), CollectorRegistry(), limit)  # type: ignore[arg-type]
    tried: list[tuple[str, str]] = []

    async def attempt(prefill: WorkerRecord, decode: WorkerRecord) -> str:
        tried.append((prefill.address, decode.address))
        if failures:
            failure = failures.pop(0)
            if isinstance(failure, (UpstreamUnavailable, WorkerLost)):   # out of rotation, as the leg client does
                pool.mark((prefill if failure.role == "prefill" else decode).key, healthy=False)
            raise failure
        return "answer"
    try:
        return tried, asyncio.run(resender.disaggregated(attempt, P0, D0))
    except UpstreamError as exc:
        return tried, exc


def _lost(role: str, worker: WorkerRecord) -> UpstreamUnavailable:
    return UpstreamUnavailable("connection error: Connection reset by peer", role, worker.address)


def _pull_failed() -> UpstreamStatus:
    body = json.dumps({"error": {"type": "kv_transfer_error", "message": "the connection to prefill was lost"}})
    return UpstreamStatus(503, body.encode(), "decode", D0.address, "1")


def test_a_lost_prefill_leg_goes_to_another_prefill_worker_with_the_same_decode_worker() -> None:
    tried, answer = _run(2, [_lost("prefill", P0)])
    assert answer == "answer" and tried == [(P0.address, D0.address), (P1.address, D0.address)]


def test_a_lost_decode_leg_goes_again_with_the_same_prefill_worker_and_another_decode_worker() -> None:
    tried, answer = _run(2, [WorkerLost("stopped answering its health checks", "decode", D0.address)])
    assert answer == "answer" and tried == [(P0.address, D0.address), (P0.address, D1.address)]


def test_resends_stop_at_the_limit_and_without_the_flag_only_a_refused_prefill_leg_goes_again() -> None:
    tried, error = _run(1, [_lost("prefill", P0), _lost("prefill", P1)])
    assert isinstance(error, UpstreamUnavailable) and len(tried) == 2
    tried, error = _run(0, [_lost("decode", D0)])
    assert isinstance(error, UpstreamUnavailable) and len(tried) == 1
    refused = UpstreamUnavailable("connection refused", "prefill", P0.address, refused=True)
    tried, answer = _run(0, [refused])
    assert answer == "answer" and tried == [(P0.address, D0.address), (P1.address, D0.address)]


@pytest.mark.parametrize("alive", [False, True])
def test_a_failed_pull_goes_again_only_when_its_prefill_worker_is_gone(alive: bool) -> None:
    tried, outcome = _run(2, [_pull_failed()], alive=alive)
    if alive:  # a live prefill's failure (a checksum, say) fails the request as before
        assert isinstance(outcome, UpstreamStatus) and len(tried) == 1
    else:
        assert outcome == "answer" and tried == [(P0.address, D0.address), (P1.address, D0.address)]
