"""A decode worker's queued prefill leg (worker/server/queued_prefill.py) against a real nats-server, the prefill
worker played by a NATS client that follows the job contract (common/prefill_job.py) and the decode engine's
stream by a scripted one: a taker that answered, and so acked the job, whose KV then never arrived has the job
put on the queue again under a new id, at most MAX_RESENDS times, and the request gets its first output from
the next taker; an answer that is an error ends the request."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, AsyncIterator, Callable, Iterator

import nats
import pytest

from common.handoff import DecodeParams, QueuedDecodeParams
from common.prefill_job import ANSWER, CONSUMER_NAME, GO, JOB_SUBJECT, STREAM_NAME, TAKEN, JobReply, PrefillJob
from common.prefill_stream import consumer_config, ensure_stream
from common.worker_record import WorkerRecord
from stack.nats import NatsServer
from worker.engine.request import RequestOutput
from worker.errors import KVTransferError
from worker.server.queued_prefill import MAX_RESENDS, QueuedPrefills

BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}
OUTPUT = RequestOutput("r", [9], "", False, None, 3, 1)


class ScriptedStream:
    """The decode engine's stream of one admitted request: its first output, or the pull's failure."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.aborted = fails, False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.fails:
            raise KVTransferError("pull of 'r': the connection to prefill peer 127.0.0.1:1 was lost")
        return OUTPUT

    def abort(self) -> None:
        self.aborted = True


async def take(url: str, port: int, answer_status: int | None) -> PrefillJob:
    """One job taken as a prefill worker would: TAKEN (told GO), then ANSWER with `answer_status` and an ack
    (None: neither, as a worker that died)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_stream(js)
        sub = await js.pull_subscribe(JOB_SUBJECT, durable=CONSUMER_NAME, stream=STREAM_NAME,
                                      config=consumer_config())
        [msg] = await sub.fetch(1, timeout=10)
        job = PrefillJob.from_bytes(msg.data)
        record = WorkerRecord("prefill", "127.0.0.1", port, "127.0.0.1", port + 1, engine_id=f"p{port}")
        told = await nc.request(job.reply, JobReply(TAKEN, job.request_id, worker=record.to_dict()).to_bytes(),
                                timeout=5)
        assert told.data == GO
        if answer_status is not None:
            await nc.publish(job.reply, JobReply(ANSWER, job.request_id, status=answer_status,
                                                 body=b'{"error": {"message": "no"}}').to_bytes())
            await msg.ack()
        return job
    finally:
        await nc.close()


async def first_output(url: str, script: Callable[[], Any], fails: Callable[[int], bool] = lambda n: n == 1
                       ) -> tuple[Any, list[DecodeParams], Any]:
    """The decode side's queued leg with the takers of `script()` running: (its first output, or the failure that
    ended it; where it pulled from; the script's result). The n-th admitted request's pull fails if `fails(n)`."""
    queue = QueuedPrefills(url)
    queue.start()
    pulls: list[DecodeParams] = []

    async def admit(pull: DecodeParams) -> list[Any]:
        pulls.append(pull)
        return [SimpleNamespace(stream=ScriptedStream(fails=fails(len(pulls))), first=None)]
    try:
        deadline = time.monotonic() + 10
        while queue.down.is_set():
            assert time.monotonic() < deadline, "the requester never connected to nats-server"
            await asyncio.sleep(0.01)
        takers = asyncio.ensure_future(script())
        job = await queue.submit_leg(QueuedDecodeParams("r"), "/v1/completions", BODY)
        try:
            outcome: Any = await asyncio.wait_for(job.first_output(await admit(await job.taken()), admit), 30)
        except KVTransferError as exc:
            outcome = exc
        finally:
            await job.close()
        return outcome, pulls, await asyncio.wait_for(takers, 30)
    finally:
        await queue.stop()


@pytest.fixture
def nats_url() -> Iterator[str]:
    server = NatsServer()
    try:
        yield server.url
    finally:
        server.stop()


def test_a_job_whose_taker_answered_but_whose_kv_never_came_is_queued_again(nats_url: str) -> None:
    async def takers() -> list[PrefillJob]:
        return [await take(nats_url, 9000, 200), await take(nats_url, 9100, 200)]

    parts, pulls, jobs = asyncio.run(first_output(nats_url, takers))
    assert [job.request_id for job in jobs] == ["r", "r-again1"]
    assert [(p.port, p.request_id) for p in pulls] == [(9001, "r"), (9101, "r-again1")]
    assert parts[0].first == OUTPUT


def test_an_answer_that_is_an_error_ends_the_request(nats_url: str) -> None:
    async def takers() -> PrefillJob:
        return await take(nats_url, 9000, 500)

    outcome, pulls, job = asyncio.run(first_output(nats_url, takers))
    assert isinstance(outcome, KVTransferError) and job.request_id == "r" and len(pulls) == 1


def test_resends_are_bounded(nats_url: str) -> None:
    async def takers() -> list[str]:
        return [(await take(nats_url, 9000 + 100 * i, 200)).request_id for i in range(MAX_RESENDS + 1)]

    outcome, pulls, ids = asyncio.run(first_output(nats_url, takers, fails=lambda n: True))
    assert isinstance(outcome, KVTransferError) and "connection to prefill peer" in str(outcome)
    assert ids == ["r", *(f"r-again{i}" for i in range(1, MAX_RESENDS + 1))] and len(pulls) == MAX_RESENDS + 1
