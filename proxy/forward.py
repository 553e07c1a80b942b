"""One client request -> one or two legs to workers -> one answer.

Disaggregated: the flow (proxy/flows.py) the strategy and the prefill worker's kv_protocol call
for starts the legs: a prefill answer (one token, not streamed) and a decode leg, stitched into
one answer whichever flow started them; or, decode_first, one leg to decode, relayed. Single leg:
colocated workers, what the prefill worker serves whole (one token, an echoed prompt, prompt
logprobs), or one conditional disaggregation keeps local (its decode worker serves it whole). A
request for several answers (prompts, choices) is one such request per answer (proxy/fanned.py).
"""
from __future__ import annotations

import functools
import time
import uuid
from typing import Any, Callable

from proxy.abandon import Abandoner
from proxy.answers import Answer, AnswerAssembler, StreamAnswer
from proxy.conditional_route import ConditionalRouter
from proxy.encode import encode_images
from proxy.errors import NoWorkers
from proxy.flows import DEFAULT_STRATEGY, DecodeLeg, decode_first, flow_for
from proxy.fanned import answer_all
from proxy.fanout import fan_out
from proxy.kv_route import KVRouter
from proxy.leg_client import LegClient, Took
from proxy.metrics import Metrics
from proxy.prefill_queue import PrefillQueue
from proxy.queued_flow import QueuedFlow, queue_legs
from proxy.resend import LegResender
from proxy.phase_timeline import LOCAL, REMOTE, PhaseTimeline
from proxy.requests import ClientRequest, leg_seed, prefill_alone, prefill_token_used, refuse_unserved
from proxy.stream_moves import MoveMetrics, StreamMover, resumable, with_token_ids
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord


class Forwarder:
    """Sends requests to workers picked from `pool`, over the client `clients(worker)` returns; disaggregated
    requests go as `strategy` (proxy/flows.py) says, and with a `conditional` router a request may go to a
    decode worker alone (proxy/conditional.py)."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream], metrics: Metrics,
                 colocated: bool, strategy: str = DEFAULT_STRATEGY, conditional: ConditionalRouter | None = None,
                 timeline: PhaseTimeline | None = None, prefill_queue: PrefillQueue | None = None,
                 resume_streams: bool = False, kv: KVRouter | None = None, resends: int = 0) -> None:
        self._pool = pool
        self._kv = kv  # --routing kv: picks both workers by cached prefix against load
        self.timeline = timeline if timeline is not None else PhaseTimeline(metrics.registry)
        self._clients = clients
        self._colocated = colocated
        self._strategy = strategy  # the flow of disaggregated requests to kv_protocol "neuron" workers
        self._conditional = conditional
        self.legs = LegClient(pool, clients, metrics, self.timeline)
        self._abandoner = Abandoner(clients)
        self._assembler = AnswerAssembler(metrics, self.timeline)
        self._queued = None if prefill_queue is None else QueuedFlow(
            prefill_queue, self.legs.start_decode, self._abandoner.abandon, strategy == "prefill_first")
        self._moves = MoveMetrics(metrics.registry) if resume_streams else None  # proxy/stream_moves.py
        self._resender = LegResender(pool, clients, metrics.registry, resends)  # proxy/resend.py

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
        prefill_legs = [self.legs.count(w) for w in self._pool.healthy("prefill")]
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

    async def _single(self, worker: WorkerRecord, request: ClientRequest, uid: str | None = None,
                      took: Took | None = None) -> Answer:
        """The client's body to `worker`, its answer relayed (under the request id `uid`, whose timeline it ends,
        if given); a leg that never started goes to another worker of its role; `took` is told which took it."""
        started = time.perf_counter()

        async def attempt(worker: WorkerRecord) -> Answer:
            leg = self.legs.start_decode(worker, request, request.body, {"X-Request-Id": uid or uuid.uuid4().hex},
                                         took)
            return await self._assembler.relay(request, uid, leg, started)
        return await self._resender.single(attempt, worker)

    async def _disaggregated(self, request: ClientRequest, received: float, decode: WorkerRecord | None = None,
                             took: Took | None = None, prefill: WorkerRecord | None = None) -> Answer:
        """`received`: when the request arrived (time.time()); `decode`: the decode worker conditional
        disaggregation weighed the request against, if it suits; `prefill`: the one KV routing picked. A prefill
        leg that never started (a draining worker refused it, or its connection was refused) goes to another
        prefill worker, with a new decode leg naming that one; with --resend-lost-legs a leg lost before the
        client had a byte sends the request again (proxy/resend.py)."""
        prefill = prefill or self._prefill_side()
        if decode is None or decode.kv_protocol != prefill.kv_protocol:  # the two legs must speak one handoff
            decode = self._pool.next("decode", prefill.kv_protocol)
        return await self._resender.disaggregated(
            lambda prefill, decode: self._handoff(request, received, prefill, decode, took), prefill, decode)

    def _prefill_side(self) -> WorkerRecord:
        """The next healthy prefill worker. With the prefill queue, a listed one failing its health checks does too:
        the job waits in the stream for whichever worker takes it (that one once it answers again, or a new one),
        and the stream's depth shows the wait."""
        try:
            return self._pool.next("prefill")
        except NoWorkers:
            listed = [w for w in self._pool.listed("prefill") if w.kv_protocol == "neuron"] if self._queued else []
            if not listed:
                raise
            return listed[0]

    async def _handoff(self, request: ClientRequest, received: float, prefill: WorkerRecord, decode: WorkerRecord,
                       took: Took | None) -> Answer:
        """The request's legs to `prefill` and `decode`, as the flow says, and the answer made of them: stitched
        from prefill's answer and the decode leg, or (decode_first) decode's leg relayed."""
        uid, seed, started = uuid.uuid4().hex, leg_seed(request), time.perf_counter()
        flow = flow_for(self._strategy, prefill)
        relay = flow is decode_first  # decode asks prefill for the KV itself and answers whole
        self.timeline.begin(uid, flow.__name__, REMOTE, received)
        abandon, rid = functools.partial(self._abandoner.abandon, prefill, uid), uid
        mover = None if relay else self._mover(request, uid, seed, prefill, decode)
        request = request if mover is None else with_token_ids(request)
        try:
            if self._queued is not None and prefill.kv_protocol == "neuron":  # the prefill leg goes through NATS
                if relay:  # decode_first: the decode worker puts the prefill leg on the queue itself
                    leg = self._queued.decode_first_leg(request, decode, uid, seed, took)
                    return await self._assembler.relay(request, uid, leg, started)
                first, leg, prefill, rid = await self._queued.handoff(request, decode, uid, seed, took)
                abandon = functools.partial(self._abandoner.abandon, prefill, rid)
            else:
                first, leg = await flow(self.legs, request, prefill, decode, uid, seed, took)
            if first is None:
                return await self._assembler.relay(request, uid, leg, started)
            token_used = prefill.kv_protocol == "nixl" or prefill_token_used(prefill, seed)
            answer = await self._assembler.answer(request, uid, first, leg, started, abandon, token_used, mover)
        except BaseException as exc:
            self.timeline.fail(uid, str(exc) or type(exc).__name__)
            if not relay:
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
            queue, task = self.legs.open_stream(worker, request.endpoint.path, body, headers)
            return DecodeLeg(worker, task, queue)
        return StreamMover(request, uid, seed, open_leg, functools.partial(self._pool.next, "decode"),
                           lambda worker, why: self._pool.mark(worker.key, healthy=False, why=why), self._moves)
