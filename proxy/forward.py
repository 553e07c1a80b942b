"""One client request -> one or two legs to workers -> one answer.

Disaggregated: a prefill leg (one token, not streamed) and a decode leg, driven as the
prefill worker's record says. kv_protocol "neuron" (our signal plane): both legs at once;
whichever fails first cancels the other. "nixl" (vLLM's NixlConnector): prefill first, then
decode with the kv_transfer_params of prefill's answer. Either way the answer is stitched
the same. Single leg: colocated workers, a request for one token (prefill answers it), or
one conditional disaggregation keeps local (its decode worker serves it whole).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from common.openai_wire import DONE, DONE_EVENT, error_body, json_bytes, sse_event
from proxy.conditional_route import ConditionalRouter
from proxy.errors import (ProxyError, ShuttingDown, UpstreamError, UpstreamProtocol, UpstreamStatus,
                          UpstreamUnavailable, to_http)
from proxy.legs import InFlightLegs
from proxy.metrics import Metrics
from proxy.requests import (ClientRequest, decode_body, leg_seed, neuron_decode_params, neuron_prefill_params,
                            nixl_prefill_params, prefill_body)
from proxy.sse import SSEDecoder, encode_raw
from proxy.stitch import StreamStitcher, first_token_repeated, merge_bodies, prefill_answer, prefill_finished
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord

log = logging.getLogger("proxy.forward")
_END = object()  # marks the normal end of a streamed leg in its queue
_QUEUE_EVENTS = 256


@dataclass(frozen=True, slots=True)
class JSONAnswer:
    body: bytes


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    events: AsyncIterator[bytes]


Answer = JSONAnswer | StreamAnswer


@dataclass(frozen=True, slots=True)
class _DecodeLeg:
    """A started decode leg; a streamed one delivers its SSE payloads through `queue`."""

    worker: WorkerRecord
    task: asyncio.Task[Any]
    queue: asyncio.Queue[Any] | None = None


class Forwarder:
    """Sends requests to workers picked from `pool`, over the client `clients(worker)` returns; with a
    `conditional` router, a request may go to a decode worker alone (see proxy.conditional)."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream],
                 metrics: Metrics, colocated: bool, conditional: ConditionalRouter | None = None) -> None:
        self._pool = pool
        self._clients = clients
        self._metrics = metrics
        self._colocated = colocated
        self._conditional = conditional
        self._pumps: set[asyncio.Task[None]] = set()  # the streamed legs being read
        self._legs = InFlightLegs()
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
        """The answer to `request`; one a draining worker refused (nothing of it started, nothing sent to the
        client yet) is sent once more, to other workers (a decode leg alone is resent, see _start_decode)."""
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
        if request.max_tokens == 1:
            return await self._single(self._pool.next("prefill"), request)
        if self._conditional is not None:
            decode = self._pool.next("decode")
            prefill_legs = [self._legs.count(w) for w in self._pool.healthy("prefill")]
            if await self._conditional.local(request, decode, prefill_legs):
                return await self._single(decode, request)
        return await self._disaggregated(request)

    async def _single(self, worker: WorkerRecord, request: ClientRequest) -> Answer:
        headers = {"X-Request-Id": uuid.uuid4().hex}
        if not request.stream:
            reply = await self._call(worker, request.endpoint.path, request.body, headers)
            return JSONAnswer(reply)
        started = time.perf_counter()
        queue, task = self._open_stream(worker, request.endpoint.path, request.body, headers)
        # Wait for the first event so that an early failure still gets an HTTP status.
        first = await _first_or_failure(asyncio.ensure_future(queue.get()), task)
        if isinstance(first, ProxyError):
            raise first
        return StreamAnswer(self._relayed(first, queue, task, started))

    async def _disaggregated(self, request: ClientRequest) -> Answer:
        prefill = self._pool.next("prefill")
        decode = self._pool.next("decode", prefill.kv_protocol)  # the two legs must speak one handoff
        uid, seed, started = uuid.uuid4().hex, leg_seed(request), time.perf_counter()
        flow = self._prefill_first if prefill.kv_protocol == "nixl" else self._concurrent
        first, leg = await flow(request, prefill, decode, uid, seed)
        return await self._answer(request, request.endpoint.id_prefix + uid, first, leg, started)

    async def _concurrent(self, request: ClientRequest, prefill: WorkerRecord, decode: WorkerRecord,
                          uid: str, seed: int | None) -> tuple[dict[str, Any], _DecodeLeg]:
        """Our signal plane: both legs at once; decode pulls the KV blocks when prefill has them."""
        headers = {"X-Request-Id": uid}
        pbody = prefill_body(request, seed, neuron_prefill_params(uid))
        dbody = decode_body(request, seed, neuron_decode_params(uid, prefill))
        prefill_task = _spawn(self._call(prefill, request.endpoint.path, pbody, headers))
        leg = self._start_decode(decode, request, dbody, headers)
        try:
            return _json(await _first_or_failure(prefill_task, leg.task), prefill), leg
        except BaseException:
            leg.task.cancel()  # a failed leg has cancelled both already; prefill's answer may not be JSON
            raise

    async def _prefill_first(self, request: ClientRequest, prefill: WorkerRecord, decode: WorkerRecord,
                             uid: str, seed: int | None) -> tuple[dict[str, Any], _DecodeLeg | None]:
        """vLLM's NixlConnector: prefill answers with where its KV lies; then decode starts with that."""
        headers = {"X-Request-Id": uid}
        pbody = prefill_body(request, seed, nixl_prefill_params())
        first = _json(await self._call(prefill, request.endpoint.path, pbody, headers), prefill)
        if prefill_finished(first):
            return first, None  # EOS at token one: decode is not called at all
        dbody = decode_body(request, seed, _handoff(first, prefill))
        return first, self._start_decode(decode, request, dbody, headers)

    def _start_decode(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any],
                      headers: dict[str, str]) -> _DecodeLeg:
        """A decode leg; one a draining worker refuses goes to another decode worker, which pulls the same KV."""
        if request.stream:
            queue, task = self._open_stream(worker, request.endpoint.path, body, headers, elsewhere=True)
            return _DecodeLeg(worker, task, queue)
        return _DecodeLeg(worker, _spawn(self._call_elsewhere(worker, request.endpoint.path, body, headers)))

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
                      leg: _DecodeLeg | None, started: float) -> Answer:
        """Prefill's answer and the decode leg (None: not called) -> the answer one server would give."""
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
        return StreamAnswer(self._stitched(stitcher, events, leg, started))

    async def _whole(self, response_id: str, first: dict[str, Any], leg: _DecodeLeg | None) -> dict[str, Any]:
        if leg is None or prefill_finished(first):
            _cancel(leg)  # EOS at token one: decode has nothing to add
            return prefill_answer(response_id, first)
        rest = _json(await leg.task, leg.worker)
        self._first_token(leg.worker, first_token_repeated(first, rest))
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
        task = _spawn(self._pump(worker, path, body, headers, queue, elsewhere))
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
                    self._pool.mark(worker.key, healthy=False)  # until a health check passes again
                raise

    async def _stitched(self, stitcher: StreamStitcher, first: list[bytes], leg: _DecodeLeg | None,
                        started: float) -> AsyncIterator[bytes]:
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
            yield _error_event(exc)
        finally:
            _cancel(leg)  # client gone or answer failed: drop the decode connection
            timer.done()

    async def _relayed(self, first: Any, queue: asyncio.Queue[Any], task: asyncio.Task[None],
                       started: float) -> AsyncIterator[bytes]:
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


async def _first_or_failure(main: asyncio.Future[Any], other: asyncio.Task[Any]) -> Any:
    """The result of `main`; if `other` fails first (or we are cancelled), cancels both and raises."""
    try:
        while not main.done():
            await asyncio.wait({main} if other.done() else {main, other}, return_when=asyncio.FIRST_COMPLETED)
            if other.done() and not other.cancelled() and other.exception() is not None:
                raise other.exception()  # type: ignore[misc]
        return main.result()
    except BaseException:
        main.cancel()
        other.cancel()
        raise


def _cancel(leg: _DecodeLeg | None) -> None:
    if leg is not None:
        leg.task.cancel()


def _handoff(first: dict[str, Any], prefill: WorkerRecord) -> dict[str, Any]:
    """The kv_transfer_params in a NixlConnector prefill's answer: what decode needs to pull the KV."""
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise UpstreamProtocol("answer has no kv_transfer_params object for decode (is it a vLLM worker with "
                               "NixlConnector?)", prefill.role, prefill.address)
    return params


def _spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(coro)
    # A leg cancelled after the other failed may fail too; that error is already reported.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _json(body: bytes, worker: WorkerRecord) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise UpstreamProtocol(f"answer is not JSON: {body[:80]!r}", worker.role, worker.address) from exc
    if not isinstance(data, dict):
        raise UpstreamProtocol("answer is not a JSON object", worker.role, worker.address)
    return data


def _error_event(exc: ProxyError) -> bytes:
    """After streaming has started the status is sent: the error goes in an SSE event."""
    status, body, _ = to_http(exc)  # no headers: they are sent already
    try:
        payload = json.loads(body)
    except ValueError:  # a worker's own error body need not be JSON
        payload = error_body(status, str(exc), "upstream_error")
    # Re-encoded, not passed on: the body may span lines, an SSE data line must not.
    return sse_event(payload) + DONE_EVENT
