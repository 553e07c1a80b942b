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
import functools
import json
import logging
import time
import uuid
from contextlib import contextmanager
from typing import Any, AsyncGenerator, Callable, Iterator

from common.openai_wire import DONE, DONE_EVENT, error_body, json_bytes, sse_event
from proxy.abandon import Abandoner
from proxy.answers import Answer, JSONAnswer, StreamAnswer
from proxy.conditional_route import ConditionalRouter
from proxy.encode import encode_images
from proxy.errors import ProxyError, ShuttingDown, UpstreamError, UpstreamStatus, UpstreamUnavailable, to_http
from proxy.flows import (DEFAULT_STRATEGY, DecodeLeg, LegCalls, decode_first_body, first_or_failure, json_object,
                         spawn, stitched_flow)
from proxy.fanned import answer_all
from proxy.fanout import fan_out
from proxy.legs import InFlightLegs
from proxy.metrics import Metrics
from proxy.requests import ClientRequest, leg_seed, prefill_alone
from proxy.sse import SSEDecoder, encode_raw
from proxy.stitch import StreamStitcher, first_token_repeated, merge_bodies, prefill_answer, prefill_finished
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord

log = logging.getLogger("proxy.forward")
_END = object()  # marks the normal end of a streamed leg in its queue
_QUEUE_EVENTS = 256


class Forwarder:
    """Sends requests to workers picked from `pool`, over the client `clients(worker)` returns; disaggregated
    requests go as `strategy` (proxy/flows.py) says, and with a `conditional` router a request may go to a
    decode worker alone (proxy/conditional.py)."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream], metrics: Metrics,
                 colocated: bool, strategy: str = DEFAULT_STRATEGY, conditional: ConditionalRouter | None = None) -> None:
        self._pool = pool
        self._clients = clients
        self._metrics = metrics
        self._colocated = colocated
        self._strategy = strategy  # the flow of disaggregated requests to kv_protocol "neuron" workers
        self._flow_legs = LegCalls(self._call, self._start_decode)
        self._conditional = conditional
        self._pumps: set[asyncio.Task[None]] = set()  # the streamed legs being read
        self._legs = InFlightLegs()
        self._abandoner = Abandoner(clients)
        self._closing = False

    def end_legs(self, worker: WorkerRecord, why: str) -> None:
        """`worker` is gone (`why`): every leg in flight to it fails now with WorkerLost, as a failed leg does,
        instead of waiting for the read timeout."""
        if ended := self._legs.end(worker, why):
            log.warning("%s worker %s: %s; ending its %d legs in flight", worker.role, worker.address, why, ended)

    def end_streams(self) -> None:
        """Shutdown: every streamed leg still open is dropped, and its client's stream ends with an error
        event saying why (rather than a cut connection)."""
        self._closing = True
        for task in list(self._pumps):
            task.cancel()

    async def handle(self, request: ClientRequest) -> Answer:
        """The answer to `request`. Disaggregated, image parts are encoded first, on an encode worker
        (proxy/encode.py), and a request for several answers is one request per answer (proxy/fanned.py)."""
        if self._colocated:
            return await self._retried(request)
        request = await encode_images(request, self._pool, self._clients)
        parts = fan_out(request)
        if parts is not None:
            return await answer_all(request, parts, self._retried)
        return await self._retried(request)

    async def _retried(self, request: ClientRequest) -> Answer:
        """One a draining worker refused (nothing of it started, nothing sent to the client yet) is sent once
        more, to other workers (a decode leg alone is resent, see _start_decode)."""
        try:
            return await self._route(request)
        except UpstreamStatus as exc:
            if not exc.draining or exc.role == "decode":
                raise
            log.info("%s: it drains; sending the request to another worker", exc)
            return await self._route(request)

    async def _route(self, request: ClientRequest) -> Answer:
        if self._colocated:
            return await self._single(self._pool.next("both"), request)
        if prefill_alone(request):
            return await self._single(self._pool.next("prefill"), request)
        decode = None
        if self._conditional is not None:
            decode = self._pool.next("decode")
            prefill_legs = [self._legs.count(w) for w in self._pool.healthy("prefill")]
            if await self._conditional.local(request, decode, prefill_legs):
                return await self._single(decode, request)
        return await self._disaggregated(request, decode)

    async def _single(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any] | None = None,
                      uid: str | None = None) -> Answer:
        """One leg, relayed: the client's body, or (decode_first) `body` under the request id `uid`, which a
        draining decode worker's refusal sends to another decode worker."""
        headers = {"X-Request-Id": uid or uuid.uuid4().hex}
        elsewhere, body = body is not None, request.body if body is None else body
        if not request.stream:
            call = self._call_elsewhere if elsewhere else self._call
            return JSONAnswer(await call(worker, request.endpoint.path, body, headers))
        started = time.perf_counter()
        queue, task = self._open_stream(worker, request.endpoint.path, body, headers, elsewhere)
        # Wait for the first event so that an early failure still gets an HTTP status.
        first = await first_or_failure(asyncio.ensure_future(queue.get()), task)
        if isinstance(first, ProxyError):
            raise first
        return StreamAnswer(self._relayed(first, queue, task, started))

    async def _disaggregated(self, request: ClientRequest, decode: WorkerRecord | None = None) -> Answer:
        """`decode`: the decode worker conditional disaggregation weighed the request against, if it suits."""
        prefill = self._pool.next("prefill")
        if decode is None or decode.kv_protocol != prefill.kv_protocol:  # the two legs must speak one handoff
            decode = self._pool.next("decode", prefill.kv_protocol)
        uid, seed, started = uuid.uuid4().hex, leg_seed(request), time.perf_counter()
        flow = stitched_flow(self._strategy, prefill)
        if flow is None:  # decode_first: decode asks prefill for the KV itself and answers whole
            return await self._single(decode, request, decode_first_body(request, uid, seed, prefill), uid)
        abandon = functools.partial(self._abandoner.abandon, prefill, uid)
        try:
            first, leg = await flow(self._flow_legs, request, prefill, decode, uid, seed)
            answer = await self._answer(request, request.endpoint.id_prefix + uid, first, leg, started, abandon)
        except BaseException:
            abandon()
            raise
        if isinstance(answer, StreamAnswer):
            return StreamAnswer(self._abandoner.unless_read(answer.events, prefill, uid))
        return answer

    def _start_decode(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any],
                      headers: dict[str, str]) -> DecodeLeg:
        """A decode leg; one a draining worker refuses goes to another decode worker, which pulls the same KV."""
        if request.stream:
            queue, task = self._open_stream(worker, request.endpoint.path, body, headers, elsewhere=True)
            return DecodeLeg(worker, task, queue)
        return DecodeLeg(worker, spawn(self._call_elsewhere(worker, request.endpoint.path, body, headers)))

    def _elsewhere(self, worker: WorkerRecord, exc: UpstreamStatus) -> WorkerRecord:
        """The worker of the same role to send a leg to that the draining `worker` refused; `exc` if none."""
        if not exc.draining:
            raise exc
        log.info("%s: it drains; sending the %s leg to another worker", exc, worker.role)
        return self._pool.next(worker.role, worker.kv_protocol)  # the draining one left rotation in _leg

    async def _call_elsewhere(self, worker: WorkerRecord, path: str, body: dict[str, Any],
                              headers: dict[str, str]) -> bytes:
        try:
            return await self._call(worker, path, body, headers)
        except UpstreamStatus as exc:
            return await self._call(self._elsewhere(worker, exc), path, body, headers)

    async def _answer(self, request: ClientRequest, response_id: str, first: dict[str, Any],
                      leg: DecodeLeg | None, started: float, abandon: Callable[[], None]) -> Answer:
        """Prefill's answer and the decode leg (None: not called) -> the answer one server would give; a stream
        that fails after it began calls `abandon` (prefill's KV may still be held, see proxy/abandon.py)."""
        try:
            if not request.stream:
                return JSONAnswer(json_bytes(await self._whole(response_id, first, leg)))
            stitcher = StreamStitcher(request, response_id, int(time.time()), first)
            events = stitcher.first()
        except BaseException:
            _cancel(leg)
            raise
        if stitcher.finished:
            _cancel(leg)  # EOS at token one: decode has nothing to add
        return StreamAnswer(self._stitched(stitcher, events, leg, started, abandon))

    async def _whole(self, response_id: str, first: dict[str, Any], leg: DecodeLeg | None) -> dict[str, Any]:
        if leg is None or prefill_finished(first):
            _cancel(leg)  # EOS at token one: decode has nothing to add
            return prefill_answer(response_id, first)
        rest = json_object(await leg.task, leg.worker)
        if (matched := first_token_repeated(first, rest)) is not None:
            self._first_token(leg.worker, matched)
        return merge_bodies(response_id, first, rest)

    def _first_token(self, decode: WorkerRecord, matched: bool) -> None:
        """Counts one checked first token; a different one means the KV did not arrive intact."""
        self._metrics.first_token(decode.kv_protocol, matched)
        if not matched:
            log.warning("decode worker %s: first token differs from prefill's (KV not intact?)", decode.address)

    async def _call(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        with self._leg(worker):
            reply = await self._clients(worker).post(path, body, headers)
            if reply.status != 200:
                raise UpstreamStatus(reply.status, reply.body, worker.role, worker.address, reply.retry_after)
            return reply.body

    def _open_stream(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                     elsewhere: bool = False) -> tuple[asyncio.Queue[Any], asyncio.Task[None]]:
        # Bounded, so that a slow client slows the worker's stream down instead of filling our memory.
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=_QUEUE_EVENTS)
        task = spawn(self._pump(worker, path, body, headers, queue, elsewhere))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return queue, task

    async def _pump(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                    queue: asyncio.Queue[Any], elsewhere: bool = False) -> None:
        """Reads one streamed leg into `queue`: SSE payloads, then _END or the error. With `elsewhere`, a
        draining worker's refusal (nothing queued yet) sends the leg to another worker of its role."""
        try:
            try:
                await self._pump_from(worker, path, body, headers, queue)
            except UpstreamStatus as exc:
                if not elsewhere:
                    raise
                await self._pump_from(self._elsewhere(worker, exc), path, body, headers, queue)
            await queue.put(_END)
        except ProxyError as exc:  # NoWorkers too, when a draining worker's leg has nowhere else to go
            await queue.put(exc)
            raise
        except asyncio.CancelledError:
            if self._closing:  # end_streams, not a client gone: the client's stream ends saying so
                await queue.put(ShuttingDown("the proxy is shutting down"))
            raise

    async def _pump_from(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                         queue: asyncio.Queue[Any]) -> None:
        with self._leg(worker):
            async with self._clients(worker).stream(path, body, headers) as reply:
                if reply.status != 200:
                    raise UpstreamStatus(reply.status, await reply.read(), worker.role, worker.address,
                                         reply.retry_after)
                decoder = SSEDecoder()
                async for chunk in reply.chunks():
                    for data in decoder.feed(chunk):
                        await queue.put(data)
                for data in decoder.end():
                    await queue.put(data)
                if decoder.pending:
                    raise UpstreamUnavailable("stream cut in the middle of an event", worker.role, worker.address)

    @contextmanager
    def _leg(self, worker: WorkerRecord) -> Iterator[None]:
        """One leg to `worker`: counted in the metrics; a worker that drops us leaves rotation."""
        with self._metrics.leg(worker):
            try:
                with self._legs.leg(worker):
                    yield
            except UpstreamError as exc:
                log.warning("%s", exc)
                if isinstance(exc, UpstreamUnavailable) or (isinstance(exc, UpstreamStatus) and exc.draining):
                    self._pool.mark(worker.key, healthy=False, why=str(exc))  # until a health check passes again
                raise

    async def _stitched(self, stitcher: StreamStitcher, first: list[bytes], leg: DecodeLeg | None,
                        started: float, abandon: Callable[[], None]) -> AsyncGenerator[bytes, None]:
        timer = _TokenTimer(self._metrics, started)
        try:
            for event in first:
                timer.tick()
                yield event
            if leg is None or leg.queue is None or stitcher.finished:
                return  # prefill's token ended the answer
            checked = False
            while (item := await leg.queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                for event in stitcher.feed(item):
                    timer.tick()
                    yield event
                if not checked and stitcher.first_token_matched is not None:
                    checked = True  # counted at once, before the client can see the end of the answer
                    self._first_token(leg.worker, stitcher.first_token_matched)
            for event in stitcher.close():
                yield event
        except ProxyError as exc:
            abandon()  # a decode leg that failed (e.g. could not authenticate) may never have released the KV
            yield _error_event(exc)
        finally:
            _cancel(leg)  # client gone or answer failed: drop the decode connection
            timer.done()

    async def _relayed(self, first: Any, queue: asyncio.Queue[Any], task: asyncio.Task[None],
                       started: float) -> AsyncGenerator[bytes, None]:
        """A single leg's stream, passed on event by event with one [DONE] at the end."""
        timer = _TokenTimer(self._metrics, started)
        item = first
        try:
            while item is not _END:
                if isinstance(item, BaseException):
                    raise item
                if item != DONE:
                    timer.tick()
                    yield encode_raw(item)
                item = await queue.get()
            yield DONE_EVENT
        except ProxyError as exc:
            yield _error_event(exc)
        finally:
            task.cancel()
            timer.done()


class _TokenTimer:
    """Observes TTFT, inter-token latency and end-to-end latency of one streamed answer."""

    def __init__(self, metrics: Metrics, started: float) -> None:
        self._metrics = metrics
        self._started = started
        self._last: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._started)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now

    def done(self) -> None:
        self._metrics.e2e.observe(time.perf_counter() - self._started)


def _cancel(leg: DecodeLeg | None) -> None:
    if leg is not None:
        leg.task.cancel()


def _error_event(exc: ProxyError) -> bytes:
    """After streaming has started the status is sent: the error goes in an SSE event."""
    status, body, _ = to_http(exc)  # no headers: they are sent already
    try:
        payload = json.loads(body)
    except ValueError:  # a worker's own error body need not be JSON
        payload = error_body(status, str(exc), "upstream_error")
    # Re-encoded, not passed on: the body may span lines, an SSE data line must not.
    return sse_event(payload) + DONE_EVENT
