"""One client request -> one or two legs to workers -> one answer.

Disaggregated: the flow (proxy/flows.py) the strategy and the prefill worker's kv_protocol call
for starts the legs: a prefill answer (one token, not streamed) and a decode leg, stitched into
one answer whichever flow started them; or, decode_first, one leg to decode, relayed. Single leg:
colocated workers, what the prefill worker serves whole (one token, an echoed prompt, prompt
logprobs), or one conditional disaggregation keeps local (its decode worker serves it whole). A
request for several answers (prompts, choices) is one such request per answer (proxy/fanned.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from proxy.abandon import Abandoner
from proxy.answers import Answer, AnswerAssembler, JSONAnswer, StreamAnswer
from proxy.conditional_route import ConditionalRouter
from proxy.encode import encode_images
from proxy.errors import (KV_TRANSFER_ERROR, NoWorkers, ProxyError, ShuttingDown, UpstreamError, UpstreamStatus,
                          UpstreamUnavailable, nothing_started)
from proxy.flows import DEFAULT_STRATEGY, DecodeLeg, LegCalls, decode_first_body, first_or_failure, spawn, stitched_flow
from proxy.fanned import answer_all
from proxy.fanout import fan_out
from proxy.kv_route import KVRouter
from proxy.legs import InFlightLegs
from proxy.metrics import Metrics
from proxy.prefill_queue import PrefillQueue
from proxy.queued_flow import QueuedFlow, queue_legs
from proxy.phase_timeline import LOCAL, REMOTE, PhaseTimeline
from proxy.requests import ClientRequest, leg_seed, prefill_alone, prefill_token_used, refuse_unserved
from proxy.sse import SSEDecoder
from proxy.explain import explained, stream_error_status
from proxy.stream_moves import MoveMetrics, StreamMover, resumable, with_token_ids
from proxy.streams import END, relayed
from proxy.timing import REQUEST_ID_HEADER, AnswerTimer, leg_answered, leg_sent
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord

log = logging.getLogger("proxy.forward")
_QUEUE_EVENTS = 256
Took = Callable[[WorkerRecord], None]  # told which worker took a leg (answered it 200)


class Forwarder:
    """Sends requests to workers picked from `pool`, over the client `clients(worker)` returns; disaggregated
    requests go as `strategy` (proxy/flows.py) says, and with a `conditional` router a request may go to a
    decode worker alone (proxy/conditional.py)."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream], metrics: Metrics,
                 colocated: bool, strategy: str = DEFAULT_STRATEGY, conditional: ConditionalRouter | None = None,
                 timeline: PhaseTimeline | None = None, prefill_queue: PrefillQueue | None = None,
                 resume_streams: bool = False, kv: KVRouter | None = None) -> None:
        self._pool = pool
        self._kv = kv  # --routing kv: picks both workers by cached prefix against load
        self.timeline = timeline if timeline is not None else PhaseTimeline(metrics.registry)
        self._clients = clients
        self._metrics = metrics
        self._colocated = colocated
        self._strategy = strategy  # the flow of disaggregated requests to kv_protocol "neuron" workers
        self._conditional = conditional
        self._pumps: set[asyncio.Task[None]] = set()  # the streamed legs being read
        self._legs = InFlightLegs()
        self._abandoner = Abandoner(clients)
        self._assembler = AnswerAssembler(metrics, self.timeline)
        self._closing = False
        self._queued = None if prefill_queue is None else QueuedFlow(
            prefill_queue, self._start_decode, self._abandoner.abandon, strategy == "prefill_first")
        self._moves = MoveMetrics(metrics.registry) if resume_streams else None  # proxy/stream_moves.py

    def legs_in_flight(self, worker: WorkerRecord) -> int:
        return self._legs.count(worker)

    def end_legs(self, worker: WorkerRecord, why: str) -> None:
        """`worker` is gone (`why`): every leg in flight to it fails now with WorkerLost, as a failed leg does,
        instead of waiting for the read timeout."""
        if ended := self._legs.end(worker, why):
            log.warning("%s worker %s: %s; ending its %d legs in flight", worker.role, worker.address, why, ended)

    def legs_in_flight(self, worker: WorkerRecord) -> int:
        return self._legs.count(worker)

    def end_streams(self) -> None:
        """Shutdown: every streamed leg still open is dropped, and its client's stream ends with an error
        event saying why (rather than a cut connection)."""
        self._closing = True
        for task in list(self._pumps):
            task.cancel()

    async def handle(self, request: ClientRequest) -> Answer:
        """The answer to `request`. Disaggregated, image parts are encoded first, on an encode worker
        (proxy/encode.py), and a request for several answers is one request per answer (proxy/fanned.py)."""
        received = time.time()
        roles = ("both",) if self._colocated else ("prefill", "decode")
        refuse_unserved(request, [worker for role in roles for worker in self._pool.healthy(role)])
        if self._colocated:
            return await self._route(request, received)
        request = await encode_images(request, self._pool, self._clients)
        parts = fan_out(request)
        if parts is not None:
            return await answer_all(request, parts, self._route)
        return await self._route(request, received)

    async def _route(self, request: ClientRequest, received: float | None = None) -> Answer:
        """Routed once: a leg a draining worker refuses (nothing of it started) is resent to another worker of
        its role, leg by leg. `received`: when the request arrived (time.time()), now if not given."""
        received = time.time() if received is None else received
        if self._colocated:
            return await self._single(self._pool.next("both"), request)
        if prefill_alone(request):
            return await self._single(self._pool.next("prefill"), request)
        picks = await self._kv.picks(request) if self._kv is not None else None
        prefill = picks.prefill if picks else None
        if self._conditional is None:
            return await self._disaggregated(request, received, picks.decode if picks else None, prefill=prefill)
        decode = picks.decode if picks else self._pool.next("decode")
        prefill_legs = [self._legs.count(w) for w in self._pool.healthy("prefill")]
        if self._queued is not None:  # the prefill side's queue is the stream's: its jobs spread over the workers
            prefill_legs = queue_legs(self._queued.queue.depth(), len(prefill_legs))
        decision = await self._conditional.decide(request, decode, prefill_legs)
        took = functools.partial(self._conditional.record, decision=decision)
        if decision.local:
            uid = uuid.uuid4().hex
            self.timeline.begin(uid, LOCAL, LOCAL, received)
            try:
                return await self._single(decode, request, uid=uid, took=took)
            except BaseException as exc:
                self.timeline.fail(uid, str(exc) or type(exc).__name__)
                raise
        return await self._disaggregated(request, received, decode, took, prefill)

    async def _single(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any] | None = None,
                      uid: str | None = None, took: Took | None = None) -> Answer:
        """One leg, relayed: the client's body, or (decode_first) `body` under the request id `uid`; a draining
        worker's refusal sends it to another worker of its role; `took` is told which worker took it."""
        headers = {"X-Request-Id": uid or uuid.uuid4().hex}
        body = request.body if body is None else body
        if not request.stream:
            answer = JSONAnswer(await self._call_elsewhere(worker, request.endpoint.path, body, headers, took))
            if uid is not None:
                self.timeline.finish(uid)
            return answer
        started = time.perf_counter()
        queue, task = self._open_stream(worker, request.endpoint.path, body, headers, took)
        # Wait for the first event so that an early failure still gets an HTTP status.
        first = await first_or_failure(asyncio.ensure_future(queue.get()), task)
        if isinstance(first, ProxyError):
            raise first
        return StreamAnswer(relayed(first, queue, task, AnswerTimer(self._metrics, started, self.timeline, uid)))

    async def _disaggregated(self, request: ClientRequest, received: float, decode: WorkerRecord | None = None,
                             took: Took | None = None, prefill: WorkerRecord | None = None) -> Answer:
        """`received`: when the request arrived (time.time()); `decode`: the decode worker conditional
        disaggregation weighed the request against, if it suits; `prefill`: the one KV routing picked. A prefill
        leg that never started (a draining worker refused it, or its connection was refused) goes to another
        prefill worker, with a new decode leg naming that one."""
        prefill = prefill or self._pool.next("prefill")
        if decode is None or decode.kv_protocol != prefill.kv_protocol:  # the two legs must speak one handoff
            decode = self._pool.next("decode", prefill.kv_protocol)
        try:
            return await self._handoff(request, received, prefill, decode, took)
        except (UpstreamStatus, UpstreamUnavailable) as exc:
            if exc.role != "prefill":
                raise
            return await self._handoff(request, received, self._elsewhere(prefill, exc), decode, took)

    async def _handoff(self, request: ClientRequest, received: float, prefill: WorkerRecord, decode: WorkerRecord,
                       took: Took | None) -> Answer:
        """The request's legs to `prefill` and `decode`, as the flow says, and the answer made of them."""
        uid, seed, started = uuid.uuid4().hex, leg_seed(request), time.perf_counter()
        flow = stitched_flow(self._strategy, prefill)
        self.timeline.begin(uid, flow.__name__ if flow is not None else "decode_first", REMOTE, received)
        abandon, rid = functools.partial(self._abandoner.abandon, prefill, uid), uid
        mover = self._mover(request, uid, seed, prefill, decode) if flow is not None else None
        request = request if mover is None else with_token_ids(request)
        try:
            if flow is None:  # decode_first: decode asks prefill for the KV itself and answers whole
                return await self._single(decode, request, decode_first_body(request, uid, seed, prefill), uid, took)
            if self._queued is not None and prefill.kv_protocol == "neuron":  # the prefill leg goes through NATS
                queued = dataclasses.replace(self._queued, start_decode=functools.partial(self._start_decode, took=took))
                first, leg, prefill, rid = await queued.handoff(request, decode, uid, seed)
                abandon = functools.partial(self._abandoner.abandon, prefill, rid)
            else:
                legs = LegCalls(self._call, functools.partial(self._start_decode, took=took))
                first, leg = await flow(legs, request, prefill, decode, uid, seed)
            token_used = prefill.kv_protocol == "nixl" or prefill_token_used(prefill, seed)
            answer = await self._assembler.answer(request, uid, first, leg, started, abandon, token_used, mover)
        except BaseException as exc:
            self.timeline.fail(uid, str(exc) or type(exc).__name__)
            if flow is not None:
                abandon()
            raise
        if isinstance(answer, StreamAnswer):
            return StreamAnswer(self._abandoner.unless_read(answer.events, prefill, rid))
        return answer

    def _mover(self, request: ClientRequest, uid: str, seed: int | None, prefill: WorkerRecord,
               decode: WorkerRecord) -> StreamMover | None:
        """With --resume-streams, what moves a streamed answer whose decode leg is lost (proxy/stream_moves.py)."""
        if self._moves is None or not resumable(request, prefill) or not resumable(request, decode):
            return None

        def open_leg(worker: WorkerRecord, body: dict[str, Any], headers: dict[str, str]) -> DecodeLeg:
            queue, task = self._open_stream(worker, request.endpoint.path, body, headers)
            return DecodeLeg(worker, task, queue)
        return StreamMover(request, uid, seed, open_leg, functools.partial(self._pool.next, "decode"),
                           lambda worker, why: self._pool.mark(worker.key, healthy=False, why=why), self._moves)

    def _start_decode(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any],
                      headers: dict[str, str], took: Took | None = None) -> DecodeLeg:
        """A decode leg; one a draining worker refuses goes to another decode worker, which pulls the same KV."""
        if request.stream:
            queue, task = self._open_stream(worker, request.endpoint.path, body, headers, took)
            return DecodeLeg(worker, task, queue)
        return DecodeLeg(worker, spawn(self._call_elsewhere(worker, request.endpoint.path, body, headers, took)))

    def _elsewhere(self, worker: WorkerRecord, exc: UpstreamStatus | UpstreamUnavailable) -> WorkerRecord:
        """The worker of the same role to send a leg to that never started on `worker` (it drains, or is gone);
        raises `exc` if the leg did start."""
        if not nothing_started(exc):
            raise exc
        log.info("%s: sending the %s leg to another worker", exc, worker.role)
        try:
            return self._pool.next(worker.role, worker.kv_protocol)  # `worker` left rotation in _leg
        except NoWorkers:
            if isinstance(exc, UpstreamUnavailable):
                raise exc from None   # no other worker: the refused connection says most
            raise

    async def _call_elsewhere(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                              took: Took | None = None) -> bytes:
        try:
            return await self._call(worker, path, body, headers, took)
        except (UpstreamStatus, UpstreamUnavailable) as exc:
            return await self._call(self._elsewhere(worker, exc), path, body, headers, took)

    async def _call(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                    took: Took | None = None) -> bytes:
        with self._leg(worker):
            leg_sent(self.timeline, worker.role, headers)
            reply = await self._clients(worker).post(path, body, headers)
            if reply.status != 200:
                raise await self._failed(worker, headers, reply.status, reply.body, reply.retry_after)
            if took is not None:
                took(worker)
            leg_answered(self.timeline, worker.role, headers)
            return reply.body

    def _open_stream(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                     took: Took | None = None) -> tuple[asyncio.Queue[Any], asyncio.Task[None]]:
        # Bounded, so that a slow client slows the worker's stream down instead of filling our memory.
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=_QUEUE_EVENTS)
        task = spawn(self._pump(worker, path, body, headers, queue, took))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return queue, task

    async def _pump(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                    queue: asyncio.Queue[Any], took: Took | None = None) -> None:
        """Reads one streamed leg into `queue`: SSE payloads, then END or the error. A draining worker's
        refusal (nothing queued yet) sends the leg to another worker of its role."""
        try:
            try:
                await self._pump_from(worker, path, body, headers, queue, took)
            except (UpstreamStatus, UpstreamUnavailable) as exc:
                await self._pump_from(self._elsewhere(worker, exc), path, body, headers, queue, took)
            await queue.put(END)
        except ProxyError as exc:  # NoWorkers too, when a draining worker's leg has nowhere else to go
            await queue.put(exc)
            raise
        except asyncio.CancelledError:
            if self._closing:  # end_streams, not a client gone: the client's stream ends saying so
                await queue.put(ShuttingDown("the proxy is shutting down"))
            raise

    async def _pump_from(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                         queue: asyncio.Queue[Any], took: Took | None = None) -> None:
        with self._leg(worker):
            leg_sent(self.timeline, worker.role, headers)
            async with self._clients(worker).stream(path, body, headers) as reply:
                if reply.status != 200:
                    raise await self._failed(worker, headers, reply.status, await reply.read(), reply.retry_after)
                if took is not None:
                    took(worker)
                decoder = SSEDecoder()
                async for chunk in reply.chunks():
                    for data in decoder.feed(chunk):
                        leg_answered(self.timeline, worker.role, headers)
                        if worker.status_port and (status := stream_error_status(data)) is not None:
                            failed = await self._failed(worker, headers, status, data.encode(), None)
                            if failed.error.get("type") == KV_TRANSFER_ERROR:  # vLLM failed its stream in-band
                                raise failed
                        await queue.put(data)
                for data in decoder.end():
                    await queue.put(data)
                if decoder.pending:
                    raise UpstreamUnavailable("stream cut in the middle of an event", worker.role, worker.address)

    async def _failed(self, worker: WorkerRecord, headers: dict[str, str], status: int, body: bytes,
                      retry_after: str | None) -> UpstreamStatus:
        """A leg's error answer; a vLLM decode worker's bare 500 for a failed KV pull is explained."""
        exc = UpstreamStatus(status, body, worker.role, worker.address, retry_after)
        return await explained(exc, worker, headers.get(REQUEST_ID_HEADER), self._clients)

    @contextmanager
    def _leg(self, worker: WorkerRecord) -> Iterator[None]:
        """One leg to `worker`: counted in the metrics; a worker that drops us leaves rotation."""
        with self._metrics.leg(worker):
            try:
                with self._legs.leg(worker):
                    yield
            except UpstreamError as exc:
                log.warning("%s", exc)
                if isinstance(exc, UpstreamUnavailable) or nothing_started(exc):
                    self._pool.mark(worker.key, healthy=False, why=str(exc))  # until a health check passes again
                raise
