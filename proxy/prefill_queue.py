"""The proxy's connection to the global prefill queue (`--prefill-queue nats://HOST:PORT`).

A requester (common/prefill_requester.py): `submit` puts a prefill job on the JetStream stream and
returns its replies, read by the queued flow (proxy/queued_flow.py). While NATS cannot be reached a job
is refused at once with `QueueUnavailable` (503 naming NATS), and a job waiting for its replies ends
with it. `depth` is the stream's real depth (jobs not yet acked), refreshed in the background and
exported as the gauge `proxy_prefill_queue_depth`.
"""
from __future__ import annotations

import asyncio
import logging

from common.prefill_job import STREAM_NAME
from common.prefill_requester import JobReplies, JobRequester
from common.prefill_stream import NATS_ERRORS
from proxy.errors import QueueUnavailable
from proxy.metrics import Metrics

__all__ = ["JobReplies", "PrefillQueue"]
log = logging.getLogger("proxy.prefill_queue")
DEPTH_EVERY_S = 0.1


class PrefillQueue(JobRequester):
    """The proxy's requester: its errors are the proxy's 503, and it reads the stream's depth."""

    def __init__(self, url: str, metrics: Metrics) -> None:
        super().__init__(url)
        self._metrics = metrics
        self._depth = 0

    def depth(self) -> int:
        """Jobs in the stream (waiting, or taken and not yet acked), as last read."""
        return self._depth

    def unavailable(self, why: str | None = None) -> QueueUnavailable:
        return QueueUnavailable(str(super().unavailable(why)))

    async def _connected(self) -> None:
        while True:
            await asyncio.sleep(DEPTH_EVERY_S)
            if not self.down.is_set():
                await self._read_depth()

    async def _read_depth(self) -> None:
        assert self._nc is not None
        try:
            info = await self._nc.jetstream().stream_info(STREAM_NAME)
        except NATS_ERRORS as exc:
            log.debug("prefill queue depth: %s", exc)
            return
        self._depth = int(info.state.messages)
        self._metrics.prefill_queue_depth.set(self._depth)
