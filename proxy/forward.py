"""One client request -> one or two legs to workers -> one answer.

Disaggregated: the prefill leg (one token, not streamed) and the decode leg run at the
same time; whichever fails first cancels the other. Single leg: colocated workers, or a
request for one token, which prefill answers on its own.
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

from proxy.errors import (ProxyError, UpstreamError, UpstreamProtocol, UpstreamStatus, UpstreamUnavailable,
                          error_body, to_http)
from proxy.metrics import Metrics
from proxy.requests import ClientRequest, decode_body, prefill_body
from proxy.sse import DONE, DONE_EVENT, SSEDecoder, encode_raw
from proxy.stitch import StreamStitcher, merge_bodies, prefill_finished
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


class Forwarder:
    """Sends requests to workers picked from `pool`, over the client `clients(worker)` returns."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream],
                 metrics: Metrics, colocated: bool) -> None:
        self._pool = pool
        self._clients = clients
        self._metrics = metrics
        self._colocated = colocated

    async def handle(self, request: ClientRequest) -> Answer:
        if self._colocated:
            return await self._single(self._pool.next("both"), request)
        if request.max_tokens == 1:
            return await self._single(self._pool.next("prefill"), request)
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
        uid = uuid.uuid4().hex
        headers, path, started = {"X-Request-Id": uid}, request.endpoint.path, time.perf_counter()
        prefill_task = _spawn(self._call(prefill, path, prefill_body(request, uid), headers))
        dbody = decode_body(request, uid, prefill)
        if request.stream:
            queue, decode_task = self._open_stream(decode, path, dbody, headers)
        else:
            decode_task = _spawn(self._call(decode, path, dbody, headers))
        try:
            first = _json(await _first_or_failure(prefill_task, decode_task), prefill)
            response_id = request.endpoint.id_prefix + uid
            if not request.stream:
                return await self._whole(response_id, first, decode_task, decode)
            stitcher = StreamStitcher(request, response_id, int(time.time()), first)
            events = stitcher.first()
        except BaseException:
            prefill_task.cancel()
            decode_task.cancel()
            raise
        if stitcher.finished:
            decode_task.cancel()  # EOS at token one: decode has nothing to add
        return StreamAnswer(self._stitched(stitcher, events, queue, decode_task, started))

    async def _whole(self, response_id: str, first: dict[str, Any], decode_task: asyncio.Task[bytes],
                     decode: WorkerRecord) -> JSONAnswer:
        if prefill_finished(first):
            decode_task.cancel()  # EOS at token one: decode has nothing to add
            return JSONAnswer(_dump({**first, "id": response_id}))
        rest = _json(await decode_task, decode)
        return JSONAnswer(_dump(merge_bodies(response_id, first, rest)))

    async def _call(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        with self._leg(worker):
            reply = await self._clients(worker).post(path, body, headers)
            if reply.status != 200:
                raise UpstreamStatus(reply.status, reply.body, worker.role, worker.address)
            return reply.body

    def _open_stream(self, worker: WorkerRecord, path: str, body: dict[str, Any],
                     headers: dict[str, str]) -> tuple[asyncio.Queue[Any], asyncio.Task[None]]:
        # Bounded, so that a slow client slows the worker's stream down instead of filling our memory.
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=_QUEUE_EVENTS)
        return queue, _spawn(self._pump(worker, path, body, headers, queue))

    async def _pump(self, worker: WorkerRecord, path: str, body: dict[str, Any],
                    headers: dict[str, str], queue: asyncio.Queue[Any]) -> None:
        """Reads one streamed leg into `queue`: SSE payloads, then _END or the error."""
        try:
            with self._leg(worker):
                async with self._clients(worker).stream(path, body, headers) as reply:
                    if reply.status != 200:
                        raise UpstreamStatus(reply.status, await reply.read(), worker.role, worker.address)
                    decoder = SSEDecoder()
                    async for chunk in reply.chunks():
                        for data in decoder.feed(chunk):
                            await queue.put(data)
                    for data in decoder.end():
                        await queue.put(data)
                    if decoder.pending:
                        raise UpstreamUnavailable("stream cut in the middle of an event", worker.role, worker.address)
            await queue.put(_END)
        except UpstreamError as exc:
            await queue.put(exc)
            raise

    @contextmanager
    def _leg(self, worker: WorkerRecord) -> Iterator[None]:
        """One leg to `worker`: counted in the metrics; a worker that drops us leaves rotation."""
        with self._metrics.leg(worker):
            try:
                yield
            except UpstreamError as exc:
                log.warning("%s", exc)
                if isinstance(exc, UpstreamUnavailable):
                    self._pool.mark(worker.key, healthy=False)  # until a health check passes again
                raise

    async def _stitched(self, stitcher: StreamStitcher, first: list[bytes], queue: asyncio.Queue[Any],
                        task: asyncio.Task[None], started: float) -> AsyncIterator[bytes]:
        timer = _TokenTimer(self._metrics, started)
        try:
            finished_by_prefill = stitcher.finished
            for event in first:
                timer.tick()
                yield event
            if finished_by_prefill:
                return
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                for event in stitcher.feed(item):
                    timer.tick()
                    yield event
            for event in stitcher.close():
                yield event
        except ProxyError as exc:
            yield _error_event(exc)
        finally:
            task.cancel()  # client gone or answer failed: drop the decode connection
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


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _error_event(exc: ProxyError) -> bytes:
    """After streaming has started the status is sent: the error goes in an SSE event."""
    status, body = to_http(exc)
    try:
        payload = json.loads(body)
    except ValueError:  # a worker's own error body need not be JSON
        payload = error_body(str(exc), "upstream_error", status)
    # The body may span lines; an SSE data line needs compact JSON.
    return encode_raw(json.dumps(payload, separators=(",", ":"))) + DONE_EVENT
