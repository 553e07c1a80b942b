"""Follows every known worker's KV cache events (ZMQ SUB) into its index (proxy/kv_index.py).

One task per events endpoint: a worker's record names it (`kv_events`), or the command line does
for a `vllm serve` worker (--kv-events). A frame that is not a batch is logged and counted, and that
worker's index is dropped (what it missed cannot be known); so is one after a sequence gap or a
restart. Routing goes on with what the indexes hold. A worker that leaves the pool is unfollowed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Iterable, Mapping

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from common.kv_events import KVEventsError, decode_frames
from common.worker_record import WorkerRecord
from proxy.kv_index import KVIndexes

log = logging.getLogger("proxy.kv_events")


class KVEventMetrics:
    """Batches read, bad frames and dropped indexes per worker, and the blocks each index holds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter("proxy_kv_event_batches", "KV event batches read", ["worker"], registry=registry)
        self.bad_frames = Counter("proxy_kv_event_bad_frames", "KV event frames that were not a batch",
                                  ["worker"], registry=registry)
        self.resets = Counter("proxy_kv_index_resets", "Worker indexes dropped (bad frame, sequence gap, "
                              "restart)", ["worker"], registry=registry)
        self.blocks = Gauge("proxy_kv_index_blocks", "Blocks a worker's index holds", ["worker"], registry=registry)


class KVEventsFollower:
    """Keeps one subscription per worker with an events endpoint; `sync` after the pool changes."""

    def __init__(self, indexes: KVIndexes, metrics: KVEventMetrics, static: Mapping[str, str] | None = None) -> None:
        self.indexes = indexes
        self._metrics = metrics
        self._static = dict(static or {})     # worker address -> endpoint, for workers whose record names none
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._stopped: set[asyncio.Task[None]] = set()   # cancelled, their sockets not yet closed

    def endpoint(self, worker: WorkerRecord) -> str:
        return worker.kv_events or self._static.get(worker.address, "")

    def sync(self, workers: Iterable[WorkerRecord]) -> None:
        """Follows each of `workers` that has an endpoint; stops following (and forgets) the others."""
        wanted = {w.key: (w, self.endpoint(w)) for w in workers}
        for key, (endpoint, task) in list(self._tasks.items()):
            if key not in wanted or wanted[key][1] != endpoint:
                task.cancel()
                self._stopped.add(task)
                task.add_done_callback(self._stopped.discard)
                del self._tasks[key]
                self.indexes.drop(key)
        for key, (worker, endpoint) in wanted.items():
            if endpoint and key not in self._tasks:
                task = asyncio.create_task(self._follow(worker, endpoint), name=f"kv-events {worker.address}")
                self._tasks[key] = (endpoint, task)

    async def run(self, workers: Callable[[], Iterable[WorkerRecord]], interval: float) -> None:
        """Syncs with `workers()` every `interval` seconds until cancelled; then closes every subscription."""
        try:
            while True:
                self.sync(workers())
                await asyncio.sleep(interval)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()] + list(self._stopped)
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.destroy(linger=0)

    async def _follow(self, worker: WorkerRecord, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        index, name = self.indexes.index(worker.key), worker.address
        log.info("%s worker %s: following its KV events at %s", worker.role, name, endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode_frames(frames)
                except KVEventsError as exc:
                    self._metrics.bad_frames.labels(name).inc()
                    index.clear()
                    index.next_seq = None
                    self._dropped(name, f"bad frame: {exc}")
                    continue
                self._metrics.batches.labels(name).inc()
                if (why := index.apply(batch)) is not None:
                    self._dropped(name, why)
                self._metrics.blocks.labels(name).set(len(index))
        finally:
            sock.close(linger=0)

    def _dropped(self, name: str, why: str) -> None:
        log.warning("worker %s: KV index dropped (%s); it fills again from the next events", name, why)
        self._metrics.resets.labels(name).inc()
