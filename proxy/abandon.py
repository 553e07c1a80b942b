"""Telling a prefill worker that a disaggregated request is over when its client left early.

A client that leaves cancels both legs, and a worker that saw its leg's connection close
aborts it. One case escapes that: the prefill leg already answered (its KV is held for the
pull) while the decode leg never reached its worker, so no decode worker will pull or release
the blocks, and they would stay held until the prefill worker's abort timeout. The proxy
cannot know which case it is in, so for every disaggregated request that does not end
normally it asks the prefill worker, in the background, to abort the id (`POST /abort_request`,
as SGLang's workers take it). A worker that lacks the endpoint, or is gone, changes nothing.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncGenerator, Callable

from proxy.upstream import Upstream
from proxy.workers import WorkerRecord

log = logging.getLogger(__name__)
ABORT_PATH = "/abort_request"
ABORT_TIMEOUT_S = 5.0


class Abandoner:
    """Sends the abort of abandoned requests; holds its background tasks until they end."""

    def __init__(self, clients: Callable[[WorkerRecord], Upstream]) -> None:
        self._clients = clients
        self._tasks: set[asyncio.Task[None]] = set()

    def abandon(self, prefill: WorkerRecord, request_id: str) -> None:
        task = asyncio.ensure_future(self._abort(prefill, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def unless_read(self, events: AsyncGenerator[bytes, None], prefill: WorkerRecord,
                          request_id: str) -> AsyncGenerator[bytes, None]:
        """`events`, passed on; if the client stops reading before their end, the request is abandoned."""
        read = False
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
            read = True
        finally:
            if not read:
                self.abandon(prefill, request_id)

    async def _abort(self, prefill: WorkerRecord, request_id: str) -> None:
        try:
            reply = await asyncio.wait_for(self._clients(prefill).post(ABORT_PATH, {"rid": request_id}, {}),
                                           ABORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - best effort: the worker's abort timeout is the fallback
            log.debug("abort of %s at %s failed: %s", request_id, prefill.address, exc)
            return
        if reply.status != 200:
            log.debug("abort of %s at %s: status %d", request_id, prefill.address, reply.status)
