"""The flows of a disaggregated request whose prefill leg goes through the global prefill queue.

The proxy puts the prefill leg on the queue as a job (proxy/prefill_queue.py) instead of sending it to a
worker it picked; the prefill worker that takes the job says so at once (TAKEN, with its worker record).
`concurrent`: the decode leg starts then, naming that worker, while the prefill runs. `prefill_first`:
it starts once the prefill's answer says where the KV lies. `decode_first`: the decode leg goes alone,
naming no prefill worker; the decode worker puts the prefill leg on the queue (worker/server/queued_prefill.py).
A job taken again (its first taker died before acking it, and the stream gave it to another) restarts the
decode leg on the new taker; a decode leg whose pull fails waits `RETAKE_S` from then for such a new taker
before the request fails. A taker acks only once the decode worker said it holds the KV, so in
`prefill_first` too, where the decode leg starts after the answer, the replies are read on while that leg
pulls (`supervised`). The prefill's answer (the first token) comes back through the queue as an HTTP prefill
leg's would.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

from common.errors import RegistrationError
from common.handoff import PrefillParams, QueuedDecodeParams
from common.prefill_job import ACKED, ANSWER, DROP, GO, REFUSED, TAKEN, JobReply, PrefillJob
from common.prefill_stream import RETAKE_S
from proxy.errors import KV_TRANSFER_ERROR, UpstreamProtocol, UpstreamStatus, UpstreamTimeout
from proxy.flows import DecodeLeg, json_object, neuron_handoff, spawn
from proxy.leg_client import Took
from proxy.prefill_queue import JobReplies, PrefillQueue
from proxy.requests import ClientRequest, decode_body, neuron_decode_params, prefill_body
from proxy.stitch import prefill_finished
from proxy.streams import END
from proxy.workers import WorkerRecord

Handoff = tuple[dict[str, Any], DecodeLeg | None, WorkerRecord, str]
StartDecode = Callable[[WorkerRecord, ClientRequest, dict[str, Any], dict[str, str], Took | None], DecodeLeg]
Abandon = Callable[[WorkerRecord, str], object]
QUEUE_ROLE = "prefill"


@dataclass(frozen=True, slots=True)
class QueuedFlow:
    """How the forwarder's queued requests go: through `queue`, their decode legs started by `start_decode`,
    the prefill of a request that fails abandoned by `abandon`; `prefill_first` as the strategy says; a job
    waits at most `timeout_s` for its answer."""

    queue: PrefillQueue
    start_decode: StartDecode
    abandon: Abandon
    prefill_first: bool
    timeout_s: float = 600.0

    def decode_first_leg(self, request: ClientRequest, decode: WorkerRecord, uid: str, seed: int | None,
                         took: Took | None = None) -> DecodeLeg:
        """decode_first: the one leg, to `decode`, which puts the prefill leg on the queue itself (`took` told
        which decode worker took it)."""
        body = decode_body(request, seed, QueuedDecodeParams(uid).to_dict())
        return self.start_decode(decode, request, body, {"X-Request-Id": uid}, took)

    async def handoff(self, request: ClientRequest, decode: WorkerRecord, uid: str, seed: int | None,
                      took: Took | None = None) -> Handoff:
        """The prefill's answer, the decode leg (None: not called; `took` told which decode worker took it), the
        prefill worker that took the job and the request id it ran it under."""
        params = PrefillParams(uid, pulled_on_stop=not self.prefill_first).to_dict()
        job = PrefillJob(uid, request.endpoint.path, prefill_body(request, seed, params), "-",
                         deadline=time.time() + self.timeout_s, answer_after_pull=not self.prefill_first)
        replies = await self.queue.submit(job)
        run = _Run(self, request, decode, uid, seed, took)
        try:
            first, leg, taker, rid = await run.answered(replies)
        except BaseException:
            run.fail()
            await replies.close()
            raise
        if not self.prefill_first or leg is None:
            await replies.close()
            return first, leg, taker, rid
        return first, run.supervised(replies), taker, rid


class _Run:
    """One queued request's state: who took its job, its decode leg."""

    def __init__(self, flow: QueuedFlow, request: ClientRequest, decode: WorkerRecord, uid: str,
                 seed: int | None, took: Took | None) -> None:
        self.flow, self.request, self.decode, self.uid, self.seed, self.took = flow, request, decode, uid, seed, took
        self.taker: WorkerRecord | None = None
        self.rid = uid   # the request id the taker runs the job under
        self.leg: DecodeLeg | None = None
        self._failed_at: float | None = None   # when the current decode leg's pull failed

    @property
    def where(self) -> str:
        return self.taker.address if self.taker else f"queue {self.flow.queue.url}"

    async def answered(self, replies: JobReplies) -> Handoff:
        """`until_answered`, within the flow's timeout."""
        try:
            return await asyncio.wait_for(self.until_answered(replies), self.flow.timeout_s)
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"no prefill answer through the prefill queue within {self.flow.timeout_s:g} s",
                                  QUEUE_ROLE, self.where) from exc

    def supervised(self, replies: JobReplies) -> DecodeLeg:
        """prefill_first: the decode leg, started again on the job's next taker should its pull fail (the taker
        died before the decode worker had the KV, so the job comes back); the replies close when it ends."""
        assert self.leg is not None
        queue: asyncio.Queue[Any] | None = None if self.leg.queue is None else asyncio.Queue(maxsize=1)
        return DecodeLeg(self.leg.worker, spawn(self._supervise(replies, queue)), queue)

    async def _supervise(self, replies: JobReplies, queue: asyncio.Queue[Any] | None) -> Any:
        try:
            while True:
                assert self.leg is not None
                try:
                    return await (self.leg.task if queue is None else _relay(self.leg, queue))
                except UpstreamStatus as exc:
                    if not _may_be_retaken(exc):
                        raise
                await self.answered(replies)   # the next taker's answer starts the next leg
        except Exception as exc:
            if queue is not None:
                await queue.put(exc)   # a stream's reader learns of the failure from its queue, as from a leg's
            raise
        finally:
            if self.leg is not None:
                self.leg.task.cancel()
            await replies.close()

    async def until_answered(self, replies: JobReplies) -> Handoff:
        while True:
            reply, msg = await self._next(replies)
            if reply.kind == TAKEN:
                try:
                    taker = _taker(reply, self.where)
                except UpstreamProtocol:
                    await msg.respond(DROP)
                    raise
                await msg.respond(GO)
                self._taken(taker, reply.request_id or self.uid)
            elif reply.kind == REFUSED:
                raise UpstreamProtocol(f"the prefill queue refused the job: {reply.message}", QUEUE_ROLE, self.where)
            elif reply.kind == ANSWER and self.taker is not None and reply.request_id in ("", self.rid):  # not stale
                return self._answered(reply), self.leg, self.taker, self.rid
            elif reply.kind == ACKED and reply.request_id == self.rid and (failed := self._leg_failure()):
                raise failed   # the taker lives and acked the job: it will not come back

    async def _next(self, replies: JobReplies) -> tuple[JobReply, Any]:
        """The next reply; raises if NATS is lost meanwhile, or the decode leg failed and no new taker came
        within RETAKE_S of that."""
        while True:
            failed = self._leg_failure()
            if failed is not None and not _may_be_retaken(failed):
                raise failed
            if failed is not None and self._failed_at is None:
                self._failed_at = time.monotonic()   # its prefill worker may have died: the job comes back
            if failed is not None and time.monotonic() >= self._failed_at + RETAKE_S:
                raise failed
            get, down = asyncio.ensure_future(replies.get()), asyncio.ensure_future(self.flow.queue.down.wait())
            waits = {get, down}
            if self.leg is not None and not self.leg.task.done():
                waits.add(self.leg.task)
            timeout = None if self._failed_at is None else max(0.0, self._failed_at + RETAKE_S - time.monotonic())
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            down.cancel()
            if get.done():
                return get.result()
            get.cancel()
            if self.flow.queue.down.is_set():
                raise self.flow.queue.unavailable()

    def _leg_failure(self) -> BaseException | None:
        task = self.leg.task if self.leg is not None else None
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    def _taken(self, taker: WorkerRecord, rid: str) -> None:
        """`taker` took the job, to run it as request `rid`: the decode leg (concurrent) starts, or starts again,
        naming it."""
        if self.taker is not None:
            self.flow.abandon(self.taker, self.rid)
        self.taker, self.rid = taker, rid
        if not self.flow.prefill_first:
            self._start_decode(decode_body(self.request, self.seed, neuron_decode_params(rid, taker)))

    def _answered(self, reply: JobReply) -> dict[str, Any]:
        assert self.taker is not None
        if reply.status != 200:
            raise UpstreamStatus(reply.status, reply.body, QUEUE_ROLE, self.taker.address)
        first = json_object(reply.body, self.taker)
        if self.flow.prefill_first and not prefill_finished(first):
            self._start_decode(decode_body(self.request, self.seed, neuron_handoff(first, self.rid, self.taker)))
        return first

    def _start_decode(self, body: dict[str, Any]) -> None:
        """Starts the decode leg, under the taker's request id; one started before, on a previous taker, is
        ended (its connection closed: the decode worker ends it once its pull from the dead taker fails)."""
        if self.leg is not None:
            self.leg.task.cancel()
        self.leg = self.flow.start_decode(self.decode, self.request, body, {"X-Request-Id": self.rid}, self.took)
        self._failed_at = None

    def fail(self) -> None:
        if self.leg is not None:
            self.leg.task.cancel()
        if self.taker is not None:
            self.flow.abandon(self.taker, self.rid)


def _taker(reply: JobReply, where: str) -> WorkerRecord:
    try:
        return WorkerRecord.from_dict(reply.worker)
    except RegistrationError as exc:
        raise UpstreamProtocol(f"the worker that took the prefill job shows no usable record: {exc}",
                               QUEUE_ROLE, where) from exc


async def _relay(leg: DecodeLeg, queue: asyncio.Queue[Any]) -> None:
    """A streamed leg's items into `queue`, until its end; its failure is raised instead if it came first (no
    event of its answer went out yet, so the leg may start again), else relayed."""
    assert leg.queue is not None
    relayed = False
    while True:
        item = await leg.queue.get()
        if isinstance(item, BaseException) and not relayed:
            raise item
        await queue.put(item)
        if item is END or isinstance(item, BaseException):
            return
        relayed = True


def _may_be_retaken(exc: BaseException) -> bool:
    """A decode leg's failure that a dead prefill worker causes: its KV pull failed."""
    return isinstance(exc, UpstreamStatus) and exc.error.get("type") == KV_TRANSFER_ERROR


def queue_legs(depth: int, workers: int) -> list[int]:
    """The stream's `depth` as prefill legs in flight over `workers` prefill workers, as conditional
    disaggregation weighs them (their mean is depth / workers; none with no worker)."""
    return [depth] + [0] * (workers - 1) if workers else []
