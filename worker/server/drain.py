"""Drain: how a worker leaves a running fleet without losing a request (SIGTERM or POST /drain).

It leaves the registry at once (the proxy stops picking it), refuses new requests with a
DrainingError (503, which the proxy retries elsewhere), and waits until the engine holds nothing:
no request running or queued, and on a prefill worker no KV block set still waiting for its decode
peer's pull (those end pulled or at --kv-abort-timeout), saying every few seconds what it still
waits for. Past the drain timeout, or at a second SIGTERM/SIGINT, the engine stops and what it
still held ends with an error. Either way `done` is then set and the server stops.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from worker.errors import DrainingError

if TYPE_CHECKING:  # the command line reads DEFAULT_TIMEOUT_S before torch is imported
    from worker.server.async_engine import AsyncEngine, RequestStream
    from worker.server.hand_back import HandBack

logger = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 60.0
POLL_S = 0.05
PROGRESS_S = 5.0  # how often a drain logs what it still waits for (first at once)
# A drained worker that left a registry still answers "draining" (503, which the proxy resends elsewhere) until
# this long after it left: a proxy that picked it just before its key went sees a refusal, not a connection
# closed unanswered. Without a registry no proxy stops picking it, so it does not wait.
LINGER_S = 1.0


class Drain:
    """One worker's drain; `start()` is idempotent, `done` is set once it is over."""

    def __init__(self, engine: AsyncEngine, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        self.leave: Callable[[], bool] | None = None  # blocking; revokes the etcd lease, if any (app.py sets it)
        self.started = False
        self.forced = False  # a second signal stopped the drain before it was over
        self.refusing: str | None = None  # why new requests are refused while the worker stays up (a role change)
        self.done = asyncio.Event()
        self._admitting = 0  # requests between the draining check and their admission by the engine
        self._task: asyncio.Task[None] | None = None
        self.hand_back: HandBack | None = None  # set: running streams are handed back, not finished here

    @property
    def refuses_new(self) -> bool:
        """Whether new requests are refused: the drain started, or a change of role is under way."""
        return self.started or self.refusing is not None

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        logger.info("draining: leaving the registry, taking no new request, finishing what runs "
                    "(at most %g s; SIGINT or SIGTERM again stops at once)", self.timeout)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def signal(self) -> None:
        """SIGTERM or SIGINT: the first starts the drain, the next one stops the worker now."""
        if not self.started:
            self.start()
        elif not self.done.is_set():
            logger.warning("stopping now, before the drain is over; what it still waited for ends with an error: %s",
                           self._waiting_for())
            self.forced = True
            self.engine.close_soon()
            self.done.set()

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Wraps a new request until the engine admitted it; DrainingError once the drain started."""
        if self.started or self.refusing:
            why = "is draining and takes no new requests" if self.started else f"takes no new requests: {self.refusing}"
            raise DrainingError(f"this worker {why}; send the request to another worker")
        self._admitting += 1
        try:
            yield
        finally:
            self._admitting -= 1

    def tracking(self, streams: Sequence[RequestStream]) -> contextlib.AbstractContextManager[None]:
        """Wraps a response streaming `streams`, which a drain then hands back (worker/server/hand_back.py)."""
        return contextlib.nullcontext() if self.hand_back is None else self.hand_back.tracking(streams)

    def idle(self) -> bool:
        """Nothing left to finish: no request on its way in, none in the engine, no KV waiting for a pull."""
        stats = self.engine.stats
        return self._admitting == 0 and (
            stats is None or stats.num_running + stats.num_waiting + stats.num_transferring == 0)

    async def wait_idle(self, timeout: float, report: bool = False) -> bool:
        """Waits until idle(), the engine stops, a second signal ends the drain or `timeout` seconds pass;
        whether it is idle. With `report`, logs what it still waits for at once and every PROGRESS_S."""
        deadline = time.monotonic() + timeout
        next_report = time.monotonic()
        while (not self.idle() and self.engine.is_alive() and not self.done.is_set()
               and time.monotonic() < deadline):
            if (self.started or self.refusing) and self.hand_back is not None:
                self.hand_back.hand_back()
            if report and time.monotonic() >= next_report:
                next_report += PROGRESS_S
                logger.info("draining: waiting for %s (%.0f s left)", self._waiting_for(), deadline - time.monotonic())
            await asyncio.sleep(POLL_S)
        return self.idle()

    async def _run(self) -> None:
        try:
            left_at = None
            if self.leave is not None and await asyncio.get_running_loop().run_in_executor(None, self.leave):
                left_at = time.monotonic()
            if not await self.wait_idle(self.timeout, report=True):
                if self.done.is_set():
                    return  # stopped by a second signal
                logger.warning("drain timeout (%g s) reached: ending the requests still in flight", self.timeout)
                self.engine.close_soon()
            else:
                logger.info("drained: nothing left in flight")
                if left_at is not None:
                    await asyncio.sleep(max(0.0, left_at + LINGER_S - time.monotonic()))
        finally:
            self.done.set()

    def _waiting_for(self) -> str:
        """What the drain still waits for, in words."""
        stats, engine = self.engine.stats, self.engine.llm_engine
        if stats is None or engine is None:
            return "the engine to start"
        held = (f"the KV of {stats.num_transferring} request(s) its decode peers have not pulled yet (freed once "
                "pulled, or at --kv-abort-timeout)" if engine.config.role == "prefill"
                else f"{stats.num_transferring} KV pull(s)")
        parts = [text for count, text in ((stats.num_running, f"{stats.num_running} running request(s)"),
                                          (stats.num_waiting, f"{stats.num_waiting} queued request(s)"),
                                          (stats.num_transferring, held),
                                          (self._admitting, f"{self._admitting} request(s) being admitted")) if count]
        return ", ".join(parts) or "nothing"
