"""decode_first through the global prefill queue (`--prefill-queue nats://HOST:PORT` on a decode worker).

The proxy sends the decode leg alone, its kv_transfer_params naming no prefill worker (`QueuedDecodeParams`).
This decode worker puts the prefill leg on the queue as a job (requester "decode"); the prefill worker that
takes it says so at once (TAKEN, with its worker record and the id it runs the job under), and only then is
the decode request admitted, pulling from that worker as any decode leg. The job is acked once this worker
told the taker its pull is done (`answer_after_pull`). A taker that dies before then has its job
redelivered: a new TAKEN ends the request admitted for the old taker and admits it again for the new one (a
pull that fails first waits `RETAKE_S` for it). A taker that answered has acked the job, which then never
comes back by itself: should the pull from it fail after all, the job is put on the queue again, under a new
id, at most `MAX_RESENDS` times. Its answer matters only for the first token's logprobs. NATS unreachable: a
503 naming it; a refused or failed job: the prefill worker's error, as over HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any, Awaitable, Callable

from nats.aio.msg import Msg

from common.errors import RegistrationError
from common.handoff import KV_TRANSFER_PARAMS, DecodeParams, QueuedDecodeParams
from common.prefill_job import ANSWER, DROP, GO, REFUSED, TAKEN, JobReply, PrefillJob, resent_id
from common.prefill_requester import JobReplies, JobRequester
from common.prefill_stream import RETAKE_S
from common.worker_record import WorkerRecord
from worker.engine.request import RequestOutput
from worker.errors import KVTransferError, RemotePrefillError, invalid
from worker.multimodal.prompt import MultiModalPrompt
from worker.server.generation import Part
from worker.server.protocol import GenerateRequest
from worker.server.remote_prefill import error_message, first_logprobs, prefill_leg_body

logger = logging.getLogger(__name__)
JOB_TIMEOUT_S = 600.0   # how long a job may wait in the queue for a prefill worker with room
MAX_RESENDS = 2         # times a job is put on the queue again after its taker answered and the pull failed
Admit = Callable[[DecodeParams], Awaitable[list[Part]]]
Start = Callable[..., Awaitable[list[Part]]]   # the app's: admits a request, optionally under an engine id


class QueuedPrefills(JobRequester):
    """This decode worker's requester on the global prefill queue."""

    def unavailable(self, why: str | None = None) -> RemotePrefillError:
        return RemotePrefillError(str(super().unavailable(why)), retryable=True)

    async def submit_leg(self, leg: QueuedDecodeParams, path: str, body: dict[str, Any]) -> QueuedPrefill:
        """Puts the prefill leg of `leg`'s request (`body` sent to `path`) on the queue."""
        job = PrefillJob(leg.request_id, path, prefill_leg_body(leg.request_id, body), "-", requester="decode",
                         deadline=time.time() + JOB_TIMEOUT_S, answer_after_pull=True)
        return QueuedPrefill(self, leg, job, await self.submit(job), body.get("logprobs") not in (None, False))


class QueuedPrefill:
    """One queued prefill leg: who took it (`taken`), then the decode request's first output (`first_output`)."""

    def __init__(self, queue: QueuedPrefills, leg: QueuedDecodeParams, job: PrefillJob, replies: JobReplies,
                 logprobs: bool) -> None:
        self._queue, self._leg, self._job, self._replies, self._logprobs = queue, leg, job, replies, logprobs
        self._next: asyncio.Future[tuple[JobReply, Msg]] | None = None
        self._rid = ""       # the id the current taker runs the job under
        self._resends = 0
        self.answer: JobReply | None = None
        self.where = f"the prefill queue (NATS at {queue.url})"

    async def taken(self) -> DecodeParams:
        """Where to pull from, once a prefill worker took the job."""
        while True:
            pull = await self._reply(None)
            if pull is not None:
                return pull

    async def first_output(self, parts: list[Part], admit: Admit) -> list[Part]:
        """The decode request (`parts`, one) with its first output (and the prefill's logprobs of it if asked
        for), admitted again through `admit` for each new taker. Raises the failure that ends it."""
        failed_at: float | None = None
        while True:
            stream = parts[0].stream
            first = asyncio.ensure_future(stream.__anext__())
            try:
                pull = await self._until_first(first, failed_at)
            except BaseException:
                first.cancel()
                stream.abort()
                raise
            if pull is None:
                parts[0].first = await self._with_logprobs(first.result())
                return parts
            first.cancel()
            stream.abort()   # its pull names the taker that died; the new taker runs the job under a new id
            logger.warning("request %s: its prefill job was taken again, by %s (as %s): pulling from it",
                           self._leg.request_id, self.where, pull.request_id)
            parts, failed_at = await admit(pull), None

    async def _until_first(self, first: asyncio.Future[RequestOutput], failed_at: float | None) -> DecodeParams | None:
        """None once `first` is done; the new place to pull from if the job was taken again meanwhile."""
        while True:
            timeout = None if failed_at is None else max(0.0, failed_at + RETAKE_S - time.monotonic())
            if self._next is None:
                self._next = asyncio.ensure_future(self._replies.get())
            down = asyncio.ensure_future(self._queue.down.wait())
            waits = {self._next, down} | ({first} if failed_at is None else set())
            try:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                down.cancel()
            if first.done() and failed_at is None:
                if (first.cancelled() or first.exception() is None or not _may_be_retaken(first.exception())
                        or not await self._may_be_taken_again()):
                    first.result()   # done, or its failure raised
                    return None
                failed_at = time.monotonic()   # its prefill worker may have died: the job comes back
            elif self._next.done():
                pull = await self._reply(first)
                if pull is not None:
                    return pull
                if failed_at is not None and not await self._may_be_taken_again():
                    first.result()   # the pull's failure ends the request
            elif self._queue.down.is_set():
                raise self._queue.unavailable()
            elif failed_at is not None and time.monotonic() >= failed_at + RETAKE_S:
                first.result()   # no new taker came: the pull's failure ends the request

    async def _may_be_taken_again(self) -> bool:
        """After the pull failed: whether a new taker may come. Not yet answered, the job is still the taker's,
        and comes back if it died. Answered (and so acked), the job is put on the queue again under a new id,
        while resends are left; an answer that is an error ends the request."""
        if self.answer is None:
            return True
        if self.answer.status != 200 or self._resends >= MAX_RESENDS:
            return False
        self._resends += 1
        if self._next is not None:
            self._next.cancel()
            self._next = None
        await self._replies.close()
        job = dataclasses.replace(self._job, request_id=resent_id(self._job.request_id, self._resends),
                                  deadline=time.time() + JOB_TIMEOUT_S)
        logger.warning("request %s: the pull from %s failed after it answered: its prefill job goes on the queue "
                       "again, as %s", self._leg.request_id, self.where, job.request_id)
        self._replies, self.answer = await self._queue.submit(job), None
        return True

    async def _reply(self, first: asyncio.Future[RequestOutput] | None) -> DecodeParams | None:
        """Handles the next reply: a place to pull from if it is a TAKEN, else None; raises a refusal or failure."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._replies.get())
        if not self._next.done():
            down = asyncio.ensure_future(self._queue.down.wait())
            try:
                await asyncio.wait({self._next, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                down.cancel()
            if not self._next.done():
                raise self._queue.unavailable()
        reply, msg = self._next.result()
        self._next = None
        if reply.kind == TAKEN:
            try:
                taker = WorkerRecord.from_dict(reply.worker)
            except RegistrationError as exc:
                await msg.respond(DROP)
                raise RemotePrefillError(f"the worker that took the prefill job of request {self._leg.request_id!r} "
                                         f"from {self.where} shows no usable record: {exc}") from exc
            await msg.respond(GO)
            self.answer, self.where, self._rid = None, f"prefill worker {taker.address}", reply.request_id
            return self._leg.pull_from(taker.kv_host, taker.kv_port, reply.request_id or self._leg.request_id,
                                       taker.engine_id or None)
        if reply.kind == REFUSED:
            raise RemotePrefillError(f"{self.where} refused the prefill job of request {self._leg.request_id!r}: "
                                     f"{reply.message}")
        if reply.kind == ANSWER and reply.request_id in ("", self._rid):   # not a previous taker's
            self.answer = reply
            if reply.status != 200 and (first is None or not first.done()):
                raise RemotePrefillError(f"remote prefill of request {self._leg.request_id!r} on {self.where} "
                                         f"answered HTTP {reply.status}: {error_message(reply.body)}",
                                         retryable=reply.status == 503)
        return None

    async def _with_logprobs(self, out: RequestOutput) -> RequestOutput:
        """Sampled on the prefill worker, the first token's logprobs are in its answer (sent once pulled)."""
        if out.logprobs != [None] or not self._logprobs:
            return out
        deadline = time.monotonic() + RETAKE_S
        with contextlib.suppress(asyncio.TimeoutError, RemotePrefillError):
            while self.answer is None:
                await asyncio.wait_for(self._reply(None), max(0.0, deadline - time.monotonic()))
        if self.answer is None or self.answer.status != 200:
            return out
        return dataclasses.replace(out, logprobs=[first_logprobs(json.loads(self.answer.body))])

    async def close(self) -> None:
        """No more replies: a prefill worker that takes the job from now on hears nobody and drops it."""
        if self._next is not None:
            self._next.cancel()
        await self._replies.close()


def _may_be_retaken(exc: BaseException) -> bool:
    """A failure a dead prefill worker causes: the KV pull from it failed."""
    return isinstance(exc, KVTransferError) and not isinstance(exc, RemotePrefillError)


async def queued_decode(queue: QueuedPrefills | None, req: GenerateRequest, path: str, body: dict[str, Any],
                        prompts: list[MultiModalPrompt], start: Start) -> list[Part]:
    """The decode leg `req` (client's `body` to `path`, `prompts` as rendered here) whose prefill leg goes through
    the queue: admitted by `start` once a prefill worker took it (again for each new taker), returned with its
    first output. A prompt with image parts goes as the client's own body, so the prefill worker renders it."""
    if queue is None:
        raise invalid("a queued decode leg needs a decode worker started with --prefill-queue", KV_TRANSFER_PARAMS)
    assert isinstance(req.leg, QueuedDecodeParams)
    if not prompts[0].spans:
        path, body = "/v1/completions", {"prompt": prompts[0].token_ids, **req.wire_sampling()}

    def admit(pull: DecodeParams) -> Awaitable[list[Part]]:
        return start(dataclasses.replace(req, leg=pull), engine_id=pull.request_id)

    job = await queue.submit_leg(req.leg, path, body)
    try:
        return await job.first_output(await admit(await job.taken()), admit)
    finally:
        await job.close()
