"""A requester's side of the global prefill queue: the proxy (a prefill leg of its flows) and a decode
worker (decode_first) put prefill jobs on the NATS JetStream stream the same way.

`submit` puts a job (common/prefill_job.py) on the stream and returns its `JobReplies`, the replies of the
prefill workers that take it. While NATS cannot be reached `down` is set and `submit` raises at once what
`unavailable` makes (a `QueueDown` naming NATS, unless a subclass makes its own error); the client
reconnects by itself, and serving resumes when NATS is back.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from common.prefill_job import JOB_SUBJECT, REPLY_HEADER, STREAM_NAME, JobError, JobReply, PrefillJob
from common.prefill_stream import NATS_ERRORS, RECONNECT_WAIT_S, connect, ensure_stream

log = logging.getLogger("prefill_queue")
PUBLISH_TIMEOUT_S = 2.0


class QueueDown(Exception):
    """The prefill queue's NATS cannot be reached; the message names it and why."""


class JobReplies:
    """The replies to one job, in order: (reply, the NATS message, to answer a TAKEN through)."""

    def __init__(self, sub: Subscription, replies: asyncio.Queue[tuple[JobReply, Msg]]) -> None:
        self._sub, self._replies = sub, replies

    async def get(self) -> tuple[JobReply, Msg]:
        return await self._replies.get()

    async def close(self) -> None:
        """No more replies: a worker that takes the job from now on hears nobody and drops it."""
        with contextlib.suppress(*NATS_ERRORS):
            await self._sub.unsubscribe()


class JobRequester:
    """One NATS connection for the owner's life (`start` / `stop`); `down` is set while NATS is unreachable."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._nc: Client | None = None
        self.down = asyncio.Event()
        self.down.set()
        self._why = "not connected yet"
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._nc is not None:
            with contextlib.suppress(*NATS_ERRORS):
                await self._nc.close()

    def unavailable(self, why: str | None = None) -> Exception:
        return QueueDown(f"the prefill queue (NATS at {self.url}) is unavailable: {why or self._why}")

    async def submit(self, job: PrefillJob) -> JobReplies:
        """Puts `job` on the stream (its `reply` is replaced by a new inbox) and returns its replies."""
        nc = self._nc
        if nc is None or self.down.is_set() or not nc.is_connected:
            raise self.unavailable()
        replies: asyncio.Queue[tuple[JobReply, Msg]] = asyncio.Queue()

        async def received(msg: Msg) -> None:
            try:
                replies.put_nowait((JobReply.from_bytes(msg.data), msg))
            except JobError as exc:
                log.warning("job %s: a prefill worker's reply is not one: %s", job.request_id, exc)

        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox, cb=received)
            job = dataclasses.replace(job, reply=inbox)
            await nc.jetstream().publish(JOB_SUBJECT, job.to_bytes(), timeout=PUBLISH_TIMEOUT_S, stream=STREAM_NAME,
                                         headers={REPLY_HEADER: inbox, "Nats-Msg-Id": job.request_id})
        except NATS_ERRORS as exc:
            raise self.unavailable(f"{type(exc).__name__}: {exc}") from exc
        return JobReplies(sub, replies)

    async def _run(self) -> None:
        while self._nc is None:
            try:
                self._nc = await connect(self.url, self._changed)
                await ensure_stream(self._nc.jetstream())
                self.down.clear()
                log.info("prefill queue: connected to %s", self.url)
            except NATS_ERRORS as exc:
                self._why = f"{type(exc).__name__}: {exc}"
                if self._nc is not None:
                    with contextlib.suppress(*NATS_ERRORS):
                        await self._nc.close()
                    self._nc = None
                await asyncio.sleep(RECONNECT_WAIT_S)
        await self._connected()

    async def _connected(self) -> None:
        """Runs once connected, for the owner's life (the proxy reads the stream's depth here)."""

    async def _changed(self, connected: bool) -> None:
        if connected:
            log.warning("prefill queue: reconnected to %s", self.url)
            with contextlib.suppress(*NATS_ERRORS):
                await ensure_stream(self._nc.jetstream())  # type: ignore[union-attr]
            self.down.clear()
        else:
            self._why = "the connection was lost"
            log.warning("prefill queue: lost %s", self.url)
            self.down.set()
