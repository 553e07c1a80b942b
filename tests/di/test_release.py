"""A decode leg that goes away has its prefill worker free the request's blocks at once, not after
its abort timeout (60 s here): worker processes, both legs sent as the proxy sends them."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.di.workers import decode_body, prefill_body, worker_pair
from tests.helpers import wait_until
from tests.worker_process import WorkerProcess

BODY = {"model": "neuron-di-builtin", "prompt": list(range(40, 140)), "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}
PROMPT_BLOCKS = 7  # ceil(100 / 16)
# Keeps the decode worker's one slot (--max-num-seqs 1) busy, so a decode leg waits before its pull.
BUSY = {"model": "neuron-di-builtin", "prompt": list(range(5, 60)), "max_tokens": 1900, "ignore_eos": True}
# The target is 1 s from the abort; the half second more covers reading /metrics over HTTP every
# 50 ms from a third process on a 2-core machine. Without the release it takes the abort timeout.
FREE_WITHIN_S = 1.5


@pytest.fixture(scope="module")
def release_pair() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    with worker_pair("shm", decode_extra=["--max-num-seqs", "1"]) as workers:
        yield workers


@pytest.fixture(autouse=True)
def blocks_free_after(release_pair: tuple[WorkerProcess, WorkerProcess]) -> Iterator[None]:
    yield
    for worker in release_pair:
        worker.wait_blocks_free(timeout=10)


async def until(predicate: Callable[[], Any], timeout: float, what: str) -> float:
    """Polls `predicate` (blocking: it reads /metrics) off the event loop; the seconds it took."""
    start = time.monotonic()
    await asyncio.to_thread(wait_until, predicate, timeout, 0.05, what)
    return time.monotonic() - start


async def dropped(task: asyncio.Task[Any]) -> None:
    """Cancels a request in flight: httpx closes its connection, which the worker sees as a client gone."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Legs:
    """Both legs of one request, sent by one client as the proxy sends them."""

    def __init__(self, client: httpx.AsyncClient, prefill: WorkerProcess, decode: WorkerProcess) -> None:
        self.client, self.prefill, self.decode = client, prefill, decode
        self.uid = uuid.uuid4().hex

    async def prefill_leg(self) -> None:
        reply = await self.client.post(f"{self.prefill.url}/v1/completions", json=prefill_body(BODY, self.uid),
                                       headers={"X-Request-Id": self.uid})
        assert reply.status_code == 200, reply.text

    def decode_leg(self) -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(self.client.post(
            f"{self.decode.url}/v1/completions", json=decode_body(BODY, self.uid, self.prefill),
            headers={"X-Request-Id": self.uid}))


async def busy(client: httpx.AsyncClient, decode: WorkerProcess) -> asyncio.Task[httpx.Response]:
    task = asyncio.create_task(client.post(f"{decode.url}/v1/completions", json=BUSY))
    await until(lambda: decode.metric("neuron_di_requests_running") == 1, 30, "the busy request")
    return task


def test_a_waiting_decode_leg_dropped_after_prefill_finished_frees_prefill_at_once(release_pair) -> None:
    prefill, decode = release_pair

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            hog = await busy(client, decode)
            try:
                legs = Legs(client, prefill, decode)
                await legs.prefill_leg()
                assert prefill.blocks_used() == PROMPT_BLOCKS       # held for the pull
                leg = legs.decode_leg()
                await until(lambda: decode.metric("neuron_di_requests_waiting") == 1, 10, "the waiting leg")
                await dropped(leg)
                await until(lambda: prefill.blocks_used() == 0, FREE_WITHIN_S, "prefill to free the blocks")
            finally:
                await dropped(hog)
    asyncio.run(run())


@pytest.mark.parametrize("stage", ["waiting", "pulling"])
def test_a_decode_leg_dropped_before_prefill_finished_frees_prefill_when_it_publishes(release_pair,
                                                                                      stage: str) -> None:
    prefill, decode = release_pair

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            hog = await busy(client, decode) if stage == "waiting" else None
            try:
                legs = Legs(client, prefill, decode)
                leg = legs.decode_leg()
                gauge = "neuron_di_requests_waiting" if hog is not None else "neuron_di_requests_transferring"
                await until(lambda: decode.metric(gauge) == 1, 10, f"the decode leg {stage}")
                await dropped(leg)
                await until(lambda: decode.metric(gauge) == 0, 10, "decode to end the leg")
                await legs.prefill_leg()
                await until(lambda: prefill.blocks_used() == 0, FREE_WITHIN_S, "prefill to free the blocks")
            finally:
                if hog is not None:
                    await dropped(hog)
    asyncio.run(run())


def test_an_aborted_prefill_leg_whose_decode_leg_never_came_frees_its_blocks_at_once(release_pair) -> None:
    """The proxy's client left after prefill answered but before the decode leg reached its worker:
    nobody will pull or release the blocks, so the proxy aborts the id at the prefill worker."""
    prefill, decode = release_pair

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            legs = Legs(client, prefill, decode)
            await legs.prefill_leg()
            assert prefill.blocks_used() == PROMPT_BLOCKS       # held for a pull that will not come
            reply = await client.post(f"{prefill.url}/abort_request", json={"rid": legs.uid})
            assert reply.status_code == 200 and reply.json() == {"status": "ok"}
            await until(lambda: prefill.blocks_used() == 0, FREE_WITHIN_S, "prefill to free the blocks")
    asyncio.run(run())


def test_a_prefill_leg_arriving_after_its_abort_is_refused_and_holds_nothing(release_pair) -> None:
    prefill, decode = release_pair

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            legs = Legs(client, prefill, decode)
            reply = await client.post(f"{prefill.url}/abort_request", json={"rid": legs.uid})
            assert reply.status_code == 200
            late = await client.post(f"{prefill.url}/v1/completions", json=prefill_body(BODY, legs.uid),
                                     headers={"X-Request-Id": legs.uid})
            assert late.status_code == 400, late.text
            assert legs.uid in late.json()["error"]["message"]
            assert prefill.blocks_used() == 0
            bad = await client.post(f"{prefill.url}/abort_request", json={"rid": 7})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
    asyncio.run(run())
