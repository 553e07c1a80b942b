"""The legs in flight to each worker, so that a worker found gone ends them at once.

A worker that stops answering without closing its connections (host gone, network cut, process
frozen) would leave its legs waiting for the read timeout. The health checks and the etcd watch
notice it within seconds; `InFlightLegs.end` then cancels every task waiting on that worker, and
the leg fails with WorkerLost instead, as any failed leg does.
"""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Iterator

from proxy.errors import WorkerLost
from proxy.workers import WorkerRecord


class InFlightLegs:
    """Which task waits on which worker; touched only from the event loop."""

    def __init__(self) -> None:
        self._tasks: dict[str, set[asyncio.Task[object]]] = {}
        self._lost: dict[asyncio.Task[object], WorkerLost] = {}

    @contextmanager
    def leg(self, worker: WorkerRecord) -> Iterator[None]:
        """The current task waits on `worker` inside this block; WorkerLost if `end` is called meanwhile."""
        task = asyncio.current_task()
        assert task is not None, "a leg runs in a task"
        self._tasks.setdefault(worker.key, set()).add(task)
        try:
            yield
        except asyncio.CancelledError as exc:
            lost = self._lost.pop(task, None)
            if lost is None:
                raise  # cancelled for another reason: client gone, other leg failed, shutdown
            task.uncancel()  # this cancellation is answered here
            raise lost from exc
        finally:
            self._lost.pop(task, None)
            tasks = self._tasks.get(worker.key)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._tasks[worker.key]

    def count(self, worker: WorkerRecord) -> int:
        """The legs in flight to `worker`."""
        return len(self._tasks.get(worker.key, ()))

    def end(self, worker: WorkerRecord, why: str) -> int:
        """Ends every leg in flight to `worker` with WorkerLost(`why`); the number of legs ended."""
        ended = 0
        for task in self._tasks.get(worker.key, ()):
            if task not in self._lost and not task.done():
                self._lost[task] = WorkerLost(why, worker.role, worker.address)
                task.cancel()
                ended += 1
        return ended
