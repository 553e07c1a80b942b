"""A prefill worker's side of the global prefill queue (`--prefill-queue nats://HOST:PORT`).

It pulls jobs (common/prefill_job.py) from the one durable consumer while it has room
(scheduler/prefill_admission.py), so that jobs wait in the stream, not on a busy worker. For each job:
tell the requester at once that this worker took it (its worker record: the signal plane the decode
leg pulls from); a requester no longer there (its client left) means the job is dropped, never run.
Then the job runs as the HTTP prefill leg it is, on this worker's own API; the answer (the first token)
goes back to the requester (`answer_after_pull`: once the KV is in the decode leg's blocks, as that decode
worker said; else at once, for the decode leg to start), and the job is acked once the KV is there, so that a
kill of this worker before then has the job redelivered and loses nothing. A job whose body breaks
the contract is refused back and acked: never retried. While a job runs its progress is signalled, so
only a worker that died has its job redelivered to another.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Callable

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from common.handoff import KV_TRANSFER_PARAMS, HandoffError, PrefillParams
from common.prefill_job import (ACKED, ANSWER, CONSUMER_NAME, GO, JOB_SUBJECT, REFUSED, REPLY_HEADER, STREAM_NAME,
                                TAKEN, JobError, JobReply, PrefillJob, attempt_id)
from common.prefill_stream import NATS_ERRORS, PROGRESS_S, connect, consumer_config, ensure_stream
from common.timeline import DECODE_DONE, PUBLISHED, RELEASED
from common.worker_record import WorkerRecord
from scheduler.prefill_admission import prefill_room

logger = logging.getLogger(__name__)
CLAIM_TIMEOUT_S = 2.0     # a requester that does not answer TAKEN within this is gone
FETCH_WAIT_S = 0.5
RETRY_S = 0.25            # after NATS failed us, before trying again
RELEASE_POLL_S = 0.005
CONFIRM_WAIT_S = 2.0      # after the KV left, how long a job waits for its decode peer to say it holds it
Load = Callable[[], tuple[int, bool]]   # the engine's requests (running and waiting), and whether it drains


class PrefillPuller:
    """Pulls and runs prefill jobs for the worker whose API is at `api_url`; `record()` is its worker record,
    `load()` its engine's load, `released(request_id)` whether a request's KV is safe in its decode peer's blocks;
    at most `max_jobs` jobs at a time."""

    def __init__(self, url: str, api_url: str, record: Callable[[], WorkerRecord | None], load: Load,
                 released: Callable[[str], bool], max_jobs: int) -> None:
        self._url, self._api_url, self._record, self._load, self._max_jobs = url, api_url, record, load, max_jobs
        self._released = released
        self._nc: Client | None = None
        self._jobs: set[asyncio.Task[None]] = set()
        self._job_ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None

    @property
    def held(self) -> int:
        """Jobs pulled and not yet acked (or handed back): redelivered to another worker if this one dies."""
        return len(self._jobs)

    def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stops pulling; jobs still running are left unacked, so another worker gets them."""
        for task in [*([self._task] if self._task else []), *self._jobs]:
            task.cancel()
        for task in [*([self._task] if self._task else []), *list(self._jobs)]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._nc is not None:
            with contextlib.suppress(*NATS_ERRORS):
                await self._nc.close()
        if self._http is not None:
            await self._http.aclose()

    async def _run(self) -> None:
        while True:
            try:
                if self._nc is None:
                    self._nc = await connect(self._url, self._changed)
                    logger.info("prefill queue: connected to %s", self._url)
                js = self._nc.jetstream()
                await ensure_stream(js)
                sub = await js.pull_subscribe(JOB_SUBJECT, durable=CONSUMER_NAME, stream=STREAM_NAME,
                                              config=consumer_config())
                await self._pull(sub)
            except NATS_ERRORS as exc:
                logger.warning("prefill queue at %s: %s: %s; trying again", self._url, type(exc).__name__, exc)
                await asyncio.sleep(RETRY_S)

    async def _changed(self, connected: bool) -> None:
        logger.warning("prefill queue: %s %s", "reconnected to" if connected else "lost", self._url)

    async def _pull(self, sub: object) -> None:
        while True:
            engine_requests, draining = self._load()
            room = prefill_room(self._max_jobs, len(self._jobs), engine_requests, draining)
            if room == 0:
                self._job_ended.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._job_ended.wait(), 0.05)
                continue
            try:
                msgs = await sub.fetch(room, timeout=FETCH_WAIT_S)  # type: ignore[attr-defined]
            except asyncio.TimeoutError:
                continue
            for msg in msgs:
                task = asyncio.create_task(self._job(msg))
                self._jobs.add(task)
                task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._jobs.discard(task)
        self._job_ended.set()
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning("prefill job failed: %s: %s", type(exc).__name__, exc)

    async def _job(self, msg: Msg) -> None:
        progress = asyncio.create_task(_signal_progress(msg))
        try:
            await self._handle(msg)
        except NATS_ERRORS as exc:  # not acked: the job goes to another worker
            logger.warning("prefill job left to another worker: %s: %s", type(exc).__name__, exc)
        finally:
            progress.cancel()

    async def _handle(self, msg: Msg) -> None:
        assert self._nc is not None
        try:
            job = PrefillJob.from_bytes(msg.data)
        except JobError as exc:
            reply_to = (msg.headers or {}).get(REPLY_HEADER)
            logger.warning("refusing a malformed prefill job (reply to %s): %s", reply_to, exc)
            if reply_to:
                await self._nc.publish(reply_to, JobReply(REFUSED, message=f"malformed prefill job: {exc}").to_bytes())
            await msg.ack()
            return
        rid = attempt_id(job.request_id, msg.metadata.num_delivered or 1)
        if job.expired() or not await self._claim(job, rid):
            logger.info("prefill job %s dropped: its requester is gone", job.request_id)
            await msg.ack()
            return
        status, body = await self._prefill(job, rid)
        if status == 503:  # this worker cannot take it now (draining, full): another one may
            await msg.nak()
            return
        if status == 200 and job.answer_after_pull:
            await self._until_released(rid, job.deadline)
        await self._nc.publish(job.reply, JobReply(ANSWER, rid, status=status, body=body).to_bytes())
        if status == 200 and not job.answer_after_pull:   # prefill_first: the decode leg starts on the answer,
            await self._until_released(rid, job.deadline)   # and the job is held until its pull ended
        await msg.ack()
        if not job.answer_after_pull:   # the requester waits for the job to come back only until it hears this
            await self._nc.publish(job.reply, JobReply(ACKED, rid).to_bytes())

    async def _until_released(self, rid: str, deadline: float) -> None:
        """Until the KV of `rid` is in its decode peer's blocks, or that peer let go of it (or it timed out)."""
        while not self._released(rid) and time.time() < deadline:
            await asyncio.sleep(RELEASE_POLL_S)

    async def _claim(self, job: PrefillJob, rid: str) -> bool:
        """Tells the requester this worker took `job`, to run as request `rid`; whether it still wants it."""
        assert self._nc is not None
        record = self._record()
        taken = JobReply(TAKEN, rid, worker=record.to_dict() if record else {})
        try:
            answer = await self._nc.request(job.reply, taken.to_bytes(), timeout=CLAIM_TIMEOUT_S)
        except NATS_ERRORS:   # no responders (the requester unsubscribed), or no answer in time
            return False
        return answer.data == GO

    async def _prefill(self, job: PrefillJob, rid: str) -> tuple[int, bytes]:
        """The job run as the HTTP prefill leg it is, as request `rid`, on this worker's own API: (status, answer
        body). A body whose kv_transfer_params are not a prefill leg's is the worker's 400, as over HTTP."""
        assert self._http is not None
        body = job.body
        with contextlib.suppress(HandoffError, KeyError):
            params = PrefillParams.parse(body[KV_TRANSFER_PARAMS])
            body = {**body, KV_TRANSFER_PARAMS: dataclasses.replace(params, request_id=rid).to_dict()}
        try:
            reply = await self._http.post(f"{self._api_url}{job.path}", json=body, headers={"X-Request-Id": rid})
        except httpx.HTTPError as exc:
            logger.warning("prefill job %s: this worker's API failed: %s", rid, exc)
            return 503, b""
        return reply.status_code, reply.content


async def _signal_progress(msg: Msg) -> None:
    while True:
        await asyncio.sleep(PROGRESS_S)
        with contextlib.suppress(*NATS_ERRORS):
            await msg.in_progress()


def worker_puller(worker: object, url: str, host: str, port: int, max_jobs: int) -> PrefillPuller:
    """The puller of the app state `worker` (worker/server/app.py) serving on `host`:`port`."""
    def load() -> tuple[int, bool]:
        stats = worker.async_engine.stats  # type: ignore[attr-defined]
        return ((0 if stats is None else stats.num_running + stats.num_waiting),
                worker.drain.refuses_new)  # type: ignore[attr-defined]

    host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    api = f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"
    def released(rid: str) -> bool:
        """Nothing was published (the answer ended at its first token), the decode peer said it holds the KV (or
        let go), or the KV left CONFIRM_WAIT_S ago with no word."""
        timeline = worker._timeline()  # type: ignore[attr-defined]
        record = timeline.get(rid) if timeline is not None else None
        phases = {} if record is None else record["phases"]
        return (PUBLISHED not in phases or DECODE_DONE in phases
                or (RELEASED in phases and time.time() - phases[RELEASED] >= CONFIRM_WAIT_S))

    return PrefillPuller(url, api, lambda: worker.record, load, released, max_jobs)  # type: ignore[attr-defined]
