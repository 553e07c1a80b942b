"""Sending a request again when a leg of it was lost before any byte of its answer reached the client
(`--resend-lost-legs N`).

A worker killed while a leg is on it, before it began to answer, fails the leg with a lost connection
(UpstreamUnavailable: refused, reset, closed) or, once the health checks or etcd find it gone, WorkerLost; a
decode worker whose prefill peer died fails its pull with a 503 kv_transfer_error. Until the forwarder hands the
HTTP layer an answer, nothing of it has reached the client: a whole answer goes out once complete, a relayed
stream once its first event came, a stitched stream once prefill's answer came (a decode leg lost after that is
a stream move's, proxy/stream_moves.py). Such a request starts its flow again, under a new request id, on
workers other than the lost one: a lost prefill leg on another prefill worker with the same decode worker, a
lost decode leg with the same prefill worker and another decode worker (a single leg on another worker of its
role). The failed attempt's prefill blocks are aborted as every failed attempt's are (proxy/abandon.py), and
its prefill worker frees them anyway once the decode engine they were named for loses its session. A 503
kv_transfer_error is resent only when the prefill worker it came from no longer answers its health check (a
live prefill's failed checksum fails the request as before).

Whatever N, a prefill leg that never started (a draining worker refused it, or its connection was refused) is
sent to another prefill worker, and on from each that refuses it too (it leaves rotation), at most once to each
worker listed, since many may drain at once (a planner flipping them); a single or decode leg that never started
goes on the same way in the leg client itself (proxy/leg_client.py).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

from prometheus_client import CollectorRegistry, Counter

from common.roles import ROLES
from proxy.errors import (KV_TRANSFER_ERROR, NoWorkers, UpstreamError, UpstreamStatus, UpstreamUnavailable,
                          WorkerLost, nothing_started)
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord

log = logging.getLogger("proxy.resend")
T = TypeVar("T")
HEALTH_PATH = "/health"
PROBE_TIMEOUT_S = 1.0


def lost_connection(exc: BaseException) -> bool:
    """Whether a leg failed because its worker went (connection refused, reset or closed; found gone)."""
    return isinstance(exc, (UpstreamUnavailable, WorkerLost))


def pull_failed(exc: BaseException) -> bool:
    """Whether a decode leg failed because its pull of the prompt's KV did, in a way sending again may mend."""
    return (isinstance(exc, UpstreamStatus) and exc.role == "decode" and exc.status == 503
            and exc.error.get("type") == KV_TRANSFER_ERROR)


class LegResender:
    """Runs a request's attempts, at most `limit` resends of one whose leg was lost before it answered; counts
    them by the lost leg's role in `registry`; `clients(worker)` probes a prefill worker a pull failed on."""

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream], registry: CollectorRegistry,
                 limit: int = 0) -> None:
        self._pool, self._clients, self.limit = pool, clients, limit
        self.resends = Counter("proxy_request_resends", "Requests sent again to other workers after a leg was "
                               "lost before anything reached the client, by the lost leg's role", ["role"],
                               registry=registry)
        for role in ROLES:
            self.resends.labels(role)

    async def disaggregated(self, attempt: Callable[[WorkerRecord, WorkerRecord], Awaitable[T]],
                            prefill: WorkerRecord, decode: WorkerRecord) -> T:
        """`attempt(prefill, decode)`, and again on other workers after a lost leg, as the module says."""
        resent = 0
        while True:
            try:
                return await attempt(prefill, decode)
            except UpstreamError as exc:
                role = await self._lost_role(exc, prefill, resent)
                if role is None:
                    raise
                resent += 1
                if role == "prefill":
                    prefill = self._other(prefill, exc)
                    if decode.kv_protocol != prefill.kv_protocol:
                        decode = self._pool.next("decode", prefill.kv_protocol)
                else:
                    decode = self._other(decode, exc, prefill.kv_protocol)
                self._resent(role, exc, prefill if role == "prefill" else decode)

    async def single(self, attempt: Callable[[WorkerRecord], Awaitable[T]], worker: WorkerRecord) -> T:
        """`attempt(worker)` (a leg answering the client whole), and again on another worker of its role after
        its worker was lost before it answered."""
        resent = 0
        while True:
            try:
                return await attempt(worker)
            except UpstreamError as exc:
                if resent >= self.limit or not lost_connection(exc) or exc.role != worker.role:
                    raise
                resent += 1
                worker = self._other(worker, exc)
                self._resent(worker.role, exc, worker)

    async def _lost_role(self, exc: UpstreamError, prefill: WorkerRecord, resent: int) -> str | None:
        """The role of the leg to send elsewhere, or None when the request fails with `exc`."""
        if exc.role == "prefill" and nothing_started(exc):
            return "prefill" if resent < max(self.limit, len(self._pool.listed("prefill"))) else None
        if resent >= self.limit:
            return None
        if lost_connection(exc) and exc.role in ("prefill", "decode"):
            return exc.role
        if pull_failed(exc) and await self._gone(prefill):
            return "prefill"
        return None

    async def _gone(self, prefill: WorkerRecord) -> bool:
        """Whether `prefill` no longer answers its health check (then it leaves rotation)."""
        try:
            reply = await self._clients(prefill).get(HEALTH_PATH, PROBE_TIMEOUT_S)
        except UpstreamError as exc:
            self._pool.mark(prefill.key, healthy=False, why=str(exc))
            return True
        return reply.status != 200 and reply.status != 503   # a draining worker still serves its pulls

    def _other(self, worker: WorkerRecord, exc: UpstreamError, kv_protocol: str | None = None) -> WorkerRecord:
        """A healthy worker of `worker`'s role other than it; raises `exc` when there is none (a draining
        worker's refusal: NoWorkers, which says why each is out)."""
        kv_protocol = kv_protocol or worker.kv_protocol
        try:
            other = self._pool.next(worker.role, kv_protocol)
            if other.key == worker.key:   # still in rotation (a pull failed on it): the next one
                other = self._pool.next(worker.role, kv_protocol)
        except NoWorkers:
            if isinstance(exc, UpstreamStatus) and exc.draining:
                raise
            raise exc from None
        if other.key == worker.key:
            raise exc
        return other

    def _resent(self, role: str, exc: UpstreamError, to: WorkerRecord) -> None:
        self.resends.labels(role).inc()
        log.info("%s; sending the request again, the %s leg to %s", exc, to.role, to.address)
