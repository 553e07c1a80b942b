"""Keeping the worker pool current: health checks, and the etcd registry (range get + watch)."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import Callable, Iterable

import aetcd

from common.errors import RegistrationError
from common.worker_record import KEY_PREFIX, VLLM_SERVER
from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord, completed, contradiction, shows_draining, shown_record

log = logging.getLogger("proxy.discovery")
PREFIX = KEY_PREFIX.encode()
_FIRST_BACKOFF = 0.2
_GONE = "its etcd record is gone"
LOST_AFTER_FAILED_CHECKS = 3


class HealthChecks:
    """GET /health on every known worker: only 200 within `timeout`, not draining, keeps it in rotation.

    A retired worker (its etcd record went) stays known while it answers, so that its legs run to
    their end as it drains; once it stops answering, or answers as a worker of another role (it changed
    role, having finished what it had), it is removed, and whatever it still had ends.

    A worker given on the command line (`static`) that shows its own record in that answer (our
    `python -m worker` does) must also agree with the command line (see workers.contradiction):
    one that does not stays out of rotation, and `problems` says why. One that agrees is used as
    it shows itself (workers.completed): its signal plane's address and engine id come from it.
    """

    def __init__(self, pool: WorkerPool, clients: Callable[[WorkerRecord], Upstream], timeout: float,
                 static: Iterable[WorkerRecord] = (), kv_ports_given: Iterable[str] = ()) -> None:
        self._pool = pool
        self._clients = clients
        self._timeout = timeout
        self._static = {w.key: w for w in static}
        self._kv_ports_given = frozenset(kv_ports_given)
        self.problems: dict[str, str] = {}  # static worker key -> how it contradicts the command line
        self._silent_rounds: dict[str, int] = {}  # worker key -> health checks in a row it did not answer
        self._servers: dict[str, str] = {}  # static worker key -> the server its GET /v1/models names
        self._seen: set[str] = set()  # the workers found healthy at least once
        self.draining: set[str] = set()  # the keys of the workers whose last answer said they drain

    async def run(self, interval: float) -> None:
        """A round every `interval` s, forever (the proxy awaits its first round before serving)."""
        while True:
            await asyncio.sleep(interval)
            await self.round()

    async def round(self) -> None:
        workers = self._pool.all()
        answers = await asyncio.gather(*(self._health(w) for w in workers))
        for worker, (answer, why) in zip(workers, answers):
            if self._pool.retired(worker.key):
                if answer is None:
                    self._pool.remove(worker.key, f"{_GONE} and it stopped answering")
                elif (shown := shown_record(answer)) is not None and shown.role != worker.role:
                    # It changed role, which it does only once its old role's requests are done: a leg still
                    # in flight to it never reached the old engine, and the new one refuses it with a 503 that
                    # sends it on to another worker of its role. Ended here, it would fail its request.
                    self._pool.remove(worker.key, f"{_GONE}: it serves role {shown.role} now", end_legs=False)
                continue
            if answer is not None and shows_draining(answer):
                why = "it drains (it takes no new request)"
                self.draining.add(worker.key)
            else:
                self.draining.discard(worker.key)
            record = None if why else self._checked(worker, answer)
            if record is not None and not record.server and worker.key in self._static:
                record = replace(record, server=await self._server(record))
            where = f"{worker.role} worker {worker.address}"
            why = why and f"{where}: {why}"
            if self._pool.mark(worker.key, record is not None, why or self.problems.get(worker.key, "")):
                self._log_change(worker, record is not None, why)
            self._count_silence(worker, answer is None)
            if record is not None and record != worker:
                plane = f"signal plane {record.kv_host}:{record.kv_port}, " if record.role == "prefill" else ""
                log.info("%s: %sengine id %r (as the worker shows itself)", where, plane, record.engine_id)
                self._pool.add(record)

    def _log_change(self, worker: WorkerRecord, healthy: bool, why: str) -> None:
        if healthy:
            again = worker.key in self._seen
            self._seen.add(worker.key)
            (log.warning if again else log.info)("%s worker %s is healthy%s", worker.role, worker.address,
                                                 " again" if again else "")
        elif why:  # a contradiction is logged where it is found
            (log.warning if worker.key in self._seen else log.info)("%s", why)

    def _count_silence(self, worker: WorkerRecord, silent: bool) -> None:
        """A worker silent for LOST_AFTER_FAILED_CHECKS rounds in a row is gone: its legs in flight end.
        One late answer only takes it out of rotation, since a busy worker may answer slowly."""
        if not silent:
            self._silent_rounds.pop(worker.key, None)
            return
        rounds = self._silent_rounds[worker.key] = self._silent_rounds.get(worker.key, 0) + 1
        if rounds == LOST_AFTER_FAILED_CHECKS:
            self._pool.lose(worker.key, f"stopped answering its health checks ({rounds} in a row)")

    async def _health(self, worker: WorkerRecord) -> tuple[bytes | None, str]:
        """The body of the worker's 200 answer to GET /health, or None and why there is none."""
        try:
            reply = await self._clients(worker).get("/health", self._timeout)
        except UpstreamTimeout:
            return None, f"no answer to GET /health within {self._timeout:g} s"
        except UpstreamError as exc:
            return None, str(exc).removeprefix(f"{worker.role} worker {worker.address}: ")
        return (reply.body, "") if reply.status == 200 else (None, f"GET /health answered HTTP {reply.status}")

    async def _server(self, worker: WorkerRecord) -> str:
        """Which server a static worker that shows no record is: `vllm serve` says `owned_by: vllm` in its
        GET /v1/models answer (a vLLM decode worker samples the first token again itself)."""
        if worker.key not in self._servers:
            try:
                reply = await self._clients(worker).get("/v1/models", self._timeout)
                owners = {m.get("owned_by") for m in json.loads(reply.body)["data"]} if reply.status == 200 else None
            except (UpstreamError, ValueError, KeyError, TypeError, AttributeError):
                owners = None
            if owners is None:
                return ""   # asked again at the next round
            self._servers[worker.key] = VLLM_SERVER if owners == {VLLM_SERVER} else ""
        return self._servers[worker.key]

    def _checked(self, worker: WorkerRecord, health: bytes) -> WorkerRecord | None:
        """The record to use for a worker that answered `health`; None if it contradicts the command line."""
        given = self._static.get(worker.key)
        if given is None:
            return worker  # discovered in etcd: the record is the worker's own already
        shown = shown_record(health)
        problem = None if shown is None else contradiction(given, shown, given.key in self._kv_ports_given)
        if problem is None:
            self.problems.pop(worker.key, None)
            return given if shown is None else completed(given, shown)
        if self.problems.get(worker.key) != problem:
            log.error("%s; it stays out of rotation", problem)
        self.problems[worker.key] = problem
        return None


class EtcdDiscovery:
    """Mirrors `/workers/` in etcd into the pool; on etcd loss keeps the last set and retries."""

    def __init__(self, pool: WorkerPool, host: str, port: int,
                 max_backoff: float = 5.0) -> None:
        self._pool = pool
        self._host = host
        self._port = port
        self._max_backoff = max_backoff
        self._backoff = _FIRST_BACKOFF
        self.synced = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                await self._sync_and_watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - grpc/etcd errors of any kind: keep serving, retry
                log.warning("etcd %s:%d unavailable (%s); keeping %d known workers, retrying in %.1fs",
                            self._host, self._port, exc, len(self._pool.all()), self._backoff)
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, self._max_backoff)

    async def _sync_and_watch(self) -> None:
        async with aetcd.Client(self._host, self._port, timeout=5) as client:
            workers, revision = await read_workers(client)
            self._pool.replace_all(workers, _GONE)
            self.synced.set()
            self._backoff = _FIRST_BACKOFF
            log.info("etcd: %d workers", len(self._pool.all()))
            watch = await client.watch_prefix(PREFIX, start_revision=revision + 1)
            async for event in watch:
                self._apply(event)
        raise ConnectionError("etcd watch ended")

    def _apply(self, event: aetcd.rtypes.Event) -> None:
        key = event.kv.key.decode(errors="replace")
        if event.kind == aetcd.rtypes.EventKind.DELETE:
            log.info("etcd: worker %s left; its requests in flight run on", key)
            self._pool.retire(key)
        elif (worker := _record(event.kv.key, event.kv.value)) is not None:
            log.info("etcd: worker %s joined", key)
            self._pool.add(worker)


async def read_workers(client: aetcd.Client) -> tuple[list[WorkerRecord], int]:
    """The well-formed records under `/workers/`, and the etcd revision they were read at."""
    snapshot = await client.get_prefix(PREFIX)
    return [w for kv in snapshot if (w := _record(kv.key, kv.value)) is not None], snapshot.header.revision


def _record(key: bytes, value: bytes) -> WorkerRecord | None:
    """The record under `key`, or None (logged) when it is malformed or filed under another key."""
    try:
        worker = WorkerRecord.from_json(value)
    except RegistrationError as exc:
        log.warning("etcd: ignoring %s: %s", key, exc)
        return None
    if worker.key.encode() != key:
        log.warning("etcd: ignoring %s: its record says %s", key, worker.key)
        return None
    return worker
