"""The legs of a request to its workers: one whole answer, or a stream pumped into a queue.

A leg that never started on its worker (a draining worker refused it, or its connection was refused)
goes to another worker of its role, and on from each that refuses it too, at most once to each worker
listed (`start_decode`, `call_or_resend`); a flow's prefill leg goes by `call`, which does not resend it
(the forwarder sends it again with a new decode leg naming the new prefill worker). Every leg is counted
per worker, so that a worker found gone ends its legs at once (proxy/legs.py), and a worker that drops us
leaves rotation until a health check passes.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from common.timeline import Timeline
from proxy.errors import (KV_TRANSFER_ERROR, NoWorkers, ProxyError, ShuttingDown, UpstreamError, UpstreamStatus,
                          UpstreamUnavailable, nothing_started)
from proxy.explain import explained, stream_error_status
from proxy.flows import DecodeLeg, spawn
from proxy.legs import InFlightLegs
from proxy.metrics import Metrics
from proxy.requests import ClientRequest
from proxy.sse import SSEDecoder
from proxy.streams import END
from proxy.timing import REQUEST_ID_HEADER, leg_answered, leg_sent
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord

log = logging.getLogger("proxy.leg_client")
_QUEUE_EVENTS = 256
Took = Callable[[WorkerRecord], None]  # told which worker took a leg (answered it 200)
T = TypeVar("T")


class LegClient:
    """Sends legs to workers of `pool` over the client `clients(worker)` returns; counts them in `metrics`
    and marks when each is sent and answered in `timeline`."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream], metrics: Metrics,
                 timeline: Timeline) -> None:
        self._pool = pool
        self._clients = clients
        self._metrics = metrics
        self._timeline = timeline
        self._pumps: set[asyncio.Task[None]] = set()  # the streamed legs being read
        self._legs = InFlightLegs()
        self._closing = False

    def count(self, worker: WorkerRecord) -> int:
        """The legs in flight to `worker`."""
        return self._legs.count(worker)

    def end(self, worker: WorkerRecord, why: str) -> None:
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

    def start_decode(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any],
                     headers: dict[str, str], took: Took | None = None) -> DecodeLeg:
        """A leg answering the client (a decode leg, or a single leg relayed whole); one that never started goes
        to another worker of its role (a decode worker pulls the same KV); `took` is told which worker took it."""
        if request.stream:
            queue, task = self.open_stream(worker, request.endpoint.path, body, headers, took)
            return DecodeLeg(worker, task, queue)
        return DecodeLeg(worker, spawn(self.call_or_resend(worker, request.endpoint.path, body, headers, took)))

    def elsewhere(self, worker: WorkerRecord, exc: UpstreamStatus | UpstreamUnavailable) -> WorkerRecord:
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

    async def call_or_resend(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                             took: Took | None = None) -> bytes:
        return await self._until_taken(worker, lambda to: self.call(to, path, body, headers, took))

    async def _until_taken(self, worker: WorkerRecord, send: Callable[[WorkerRecord], Awaitable[T]]) -> T:
        """`send(worker)`; a leg that never started there goes on to other workers of its role until one takes
        it (each that refused it left rotation), at most once to each worker listed."""
        for _ in self._pool.listed(worker.role):
            try:
                return await send(worker)
            except (UpstreamStatus, UpstreamUnavailable) as exc:
                worker = self.elsewhere(worker, exc)
        return await send(worker)

    async def call(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                   took: Took | None = None) -> bytes:
        """One whole answer from `worker`, not resent elsewhere."""
        with self._leg(worker):
            leg_sent(self._timeline, worker.role, headers)
            reply = await self._clients(worker).post(path, body, headers)
            if reply.status != 200:
                raise await self._failed(worker, headers, reply.status, reply.body, reply.retry_after)
            if took is not None:
                took(worker)
            leg_answered(self._timeline, worker.role, headers)
            return reply.body

    def open_stream(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                    took: Took | None = None) -> tuple[asyncio.Queue[Any], asyncio.Task[None]]:
        """A streamed leg read into the queue returned: SSE payloads, then END or the error."""
        # Bounded, so that a slow client slows the worker's stream down instead of filling our memory.
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=_QUEUE_EVENTS)
        task = spawn(self._pump(worker, path, body, headers, queue, took))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return queue, task

    async def _pump(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                    queue: asyncio.Queue[Any], took: Took | None = None) -> None:
        """Reads one streamed leg into `queue`; one that never started goes on to other workers of its role."""
        try:
            await self._until_taken(worker, lambda to: self._pump_from(to, path, body, headers, queue, took))
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
            leg_sent(self._timeline, worker.role, headers)
            async with self._clients(worker).stream(path, body, headers) as reply:
                if reply.status != 200:
                    raise await self._failed(worker, headers, reply.status, await reply.read(), reply.retry_after)
                if took is not None:
                    took(worker)
                decoder = SSEDecoder()
                async for chunk in reply.chunks():
                    for data in decoder.feed(chunk):
                        leg_answered(self._timeline, worker.role, headers)
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
