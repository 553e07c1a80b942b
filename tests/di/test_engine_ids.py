"""Decode workers sharing one engine id, and a DEALER posing as a live decode worker, never get
another worker's KV: the prefill worker binds each engine id to one live session."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from typing import Any, Iterator

import httpx
import pytest
import zmq

from common.kv_secret import new_nonce
from neuron_connector.protocol import Handshake, LookupAll, Release
from tests.di.workers import disaggregated, worker_pair
from tests.helpers import wait_until
from tests.worker_process import WorkerProcess

SHARED_ID = "decode-shared"
ABORT_TIMEOUT_S = 3


def bodies(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"model": "neuron-di-builtin", "prompt": [rng.randrange(32, 127) for _ in range(rng.randrange(5, 90))],
             "max_tokens": 6, "temperature": 0, "ignore_eos": True} for _ in range(count)]


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerProcess, WorkerProcess, WorkerProcess]]:
    """One prefill worker and two decode workers started with the same --engine-id."""
    with worker_pair("shm", ["--kv-abort-timeout", str(ABORT_TIMEOUT_S)], ["--engine-id", SHARED_ID]) as (p, d1):
        d2 = WorkerProcess("decode", "shm", ["--engine-id", SHARED_ID])
        try:
            yield p, d1, d2
        finally:
            d2.stop()


def answers(worker: WorkerProcess, requests: list[dict[str, Any]]) -> list[Any]:
    return [httpx.post(f"{worker.url}/v1/completions", json=b, timeout=120.0).json()["choices"] for b in requests]


async def through(prefill: WorkerProcess, decodes: list[WorkerProcess],
                  requests: list[dict[str, Any]]) -> list[httpx.Response]:
    """Each request through `prefill` and decodes[i % len(decodes)], all at once; the decode legs' answers."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        legs = await asyncio.gather(*(disaggregated(client, prefill, decodes[i % len(decodes)], "/v1/completions", b)
                                      for i, b in enumerate(requests)))
    for p_response, _ in legs:
        assert p_response.status_code == 200, p_response.text
    return [d_response for _, d_response in legs]


def test_a_second_decode_worker_with_a_taken_engine_id_is_refused(workers, both_worker: WorkerProcess) -> None:
    prefill, first, second = workers
    requests = bodies(13, seed=1)
    want = answers(both_worker, requests)
    # The first decode worker's session holds the id; then 12 requests alternate between the two.
    assert asyncio.run(through(prefill, [first], requests[:1]))[0].json()["choices"] == want[0]
    got = asyncio.run(through(prefill, [first, second], requests[1:]))
    for i, response in enumerate(got):
        if i % 2 == 0:
            assert response.status_code == 200 and response.json()["choices"] == want[1 + i], response.text
        else:
            assert response.status_code == 500, response.text
            message = response.json()["error"]["message"]
            assert f"refused our handshake as engine '{SHARED_ID}'" in message, message
            assert "give each decode worker a unique --engine-id" in message, message
    for worker in workers:
        worker.wait_blocks_free(timeout=ABORT_TIMEOUT_S + 20)


def test_an_intruder_posing_as_a_live_decode_worker_changes_nothing(workers, both_worker: WorkerProcess) -> None:
    prefill, victim, _ = workers
    requests = bodies(20, seed=2)
    want = answers(both_worker, requests)
    assert asyncio.run(through(prefill, [victim], requests[:1]))[0].json()["choices"] == want[0]
    ctx = zmq.Context()
    try:
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.RCVTIMEO, 10_000)
        intruder.setsockopt(zmq.IDENTITY, SHARED_ID.encode())     # the victim's id as its ZMQ identity too
        intruder.connect(f"tcp://127.0.0.1:{prefill.kv_port}")
        intruder.send(Handshake(SHARED_ID, new_nonce()).to_bytes())
        assert json.loads(intruder.recv())["code"] == "engine_id_in_use"
        intruder.send(LookupAll("stolen", (0,)).to_bytes())
        assert json.loads(intruder.recv())["code"] == "handshake_required"
        intruder.send(Release("stolen").to_bytes())
        intruder.close()
    finally:
        ctx.term()
    got = asyncio.run(through(prefill, [victim], requests))
    assert [r.json()["choices"] if r.status_code == 200 else r.text for r in got] == want
    for worker in (prefill, victim):
        worker.wait_blocks_free()


@pytest.mark.slow   # 7 s of waiting out a lease; lease expiry and keep-alive: tests/neuron_connector/test_registry.py
def test_a_frozen_decode_worker_loses_its_engine_id_within_seconds(workers, both_worker: WorkerProcess) -> None:
    """A peer that stops answering (its host gone, here its process stopped) misses the signal plane's
    heartbeats: the prefill worker drops its connection, and the id is free for another decode worker."""
    prefill, frozen, second = workers
    request = bodies(1, seed=3)
    want = answers(both_worker, request)[0]
    assert asyncio.run(through(prefill, [frozen], request))[0].json()["choices"] == want
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        def second_served() -> bool:
            response = asyncio.run(through(prefill, [second], request))[0]
            # Not served yet: raised, so that a timeout names the last answer the second worker gave.
            assert response.status_code == 200 and response.json()["choices"] == want, response.text
            return True
        wait_until(second_served, timeout=30, interval=0.5, what="the second decode worker to take the id")
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    for worker in workers:
        worker.wait_blocks_free(timeout=ABORT_TIMEOUT_S + 20)
