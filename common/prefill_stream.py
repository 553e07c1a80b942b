"""The global prefill queue's NATS JetStream objects, made the same way by every process that uses them:
the work-queue stream of jobs (file storage, so that jobs outlive a restart of nats-server) and the one
durable pull consumer all prefill workers share. A job not acked within `ACK_WAIT_S` (its worker died: a
live one signals progress every `PROGRESS_S`) goes to another worker, at most `MAX_DELIVER` times."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from common.prefill_job import CONSUMER_NAME, JOB_SUBJECT, STREAM_NAME

ACK_WAIT_S = 3.0
PROGRESS_S = 1.0
MAX_DELIVER = 5
MAX_JOB_AGE_S = 600.0
# After a pull from the worker that took a job failed (it may have died): how long the requester waits for the job
# to come back, ACK_WAIT_S after that worker's last sign of life, and to be taken again by a worker with room (the
# survivors are busier by then). A taker still alive answers the job instead, and the wait ends.
RETAKE_S = 30.0
RECONNECT_WAIT_S = 0.25
NATS_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


def stream_config() -> StreamConfig:
    return StreamConfig(name=STREAM_NAME, subjects=[JOB_SUBJECT], retention=RetentionPolicy.WORK_QUEUE,
                        storage=StorageType.FILE, max_age=MAX_JOB_AGE_S)


def consumer_config() -> ConsumerConfig:
    return ConsumerConfig(durable_name=CONSUMER_NAME, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
                          max_deliver=MAX_DELIVER, max_ack_pending=-1)


async def connect(url: str, on_change: Callable[[bool], Awaitable[None]] | None = None) -> Client:
    """A client that reconnects by itself, forever, every RECONNECT_WAIT_S; `on_change(connected)` hears of each
    disconnection and reconnection. Raises a NATS error when `url` cannot be reached now."""
    async def disconnected() -> None:
        if on_change is not None:
            await on_change(False)

    async def reconnected() -> None:
        if on_change is not None:
            await on_change(True)

    async def error(exc: Exception) -> None:
        pass   # reconnects are logged by the callers through on_change; nats-py would print every refusal

    options: dict[str, Any] = dict(connect_timeout=2, allow_reconnect=True, max_reconnect_attempts=-1,
                                   reconnect_time_wait=RECONNECT_WAIT_S, disconnected_cb=disconnected,
                                   reconnected_cb=reconnected, error_cb=error)
    return await nats.connect(url, **options)


async def ensure_stream(js: JetStreamContext) -> None:
    """The job stream, made if missing (idempotent: every process calls it)."""
    try:
        await js.stream_info(STREAM_NAME)
    except nats.js.errors.NotFoundError:
        await js.add_stream(stream_config())
