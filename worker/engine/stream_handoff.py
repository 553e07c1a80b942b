"""Decode: a running stream handed to another decode worker with its KV, as a prefill worker hands a prompt's.

A draining decode worker started with a hand-back KV port stops decoding a running request between two
steps and publishes its blocks with the connector's SendBuffer, exactly as a prefill worker publishes a
finished prompt: the blocks of every token whose KV is computed (prompt and outputs but the newest), and
the newest token in the place of prefill's first. The decode worker that resumes the stream pulls them
over the transfer engine (fences, checksums and timeouts as for any pull) and goes on from that token
without recomputing anything. The blocks stay held, TRANSFERRING, until the pull ends, fails or the
SendBuffer's abort timeout passes; then they are freed.
"""
from __future__ import annotations

import logging

from common.handoff import PrefillHandoff
from neuron_connector import ConnectorError
from scheduler.sequence import SequenceStatus, blocks_for
from worker.engine.kv_connector import KVConnector
from worker.engine.request import Request
from worker.engine.roles import EngineParts

logger = logging.getLogger(__name__)


def source_blocks(request: Request) -> int:
    """The blocks a stream's KV fills: every token but the newest, whose KV the next step computes."""
    return blocks_for(len(request) - 1, request.block_size)


class StreamHandOffs:
    """The running requests this decode worker froze and published for another decode worker's pull."""

    def __init__(self, parts: EngineParts, kv: KVConnector) -> None:
        self.parts, self.kv = parts, kv

    def hand_off(self, request_id: str) -> PrefillHandoff | None:
        """Freezes running request `request_id` and publishes its KV; where to pull it from, or None when it
        cannot be handed off so (no hand-back port, not running between steps): the caller then ends it."""
        scheduler = self.parts.scheduler
        request = self.parts.requests.generating(request_id)
        if (self.kv.send is None or request is None or request.status is not SequenceStatus.RUNNING
                or request.num_output_tokens == 0 or request.num_computed_tokens != len(request) - 1):
            return None
        scheduler.hold(request)
        request.finish_reason = "abort"   # no output comes after: an abort of its id finds nothing to end
        try:
            self.kv.publish(request_id, request.block_table[:source_blocks(request)], request.token_ids[-1])
        except ConnectorError:
            logger.exception("could not publish the KV of stream %s for another decode worker", request_id)
            self._free(request)
            return None
        return self.kv.handoff(request_id)

    def take_released(self, released: list[str]) -> None:
        """Frees the blocks of every handed-off stream in `released` (pulled, failed or not pulled in time)."""
        for request_id in released:
            if (request := self.parts.scheduler.transferring.get(request_id)) is not None:
                self._free(request)

    def _free(self, request: Request) -> None:
        self.parts.scheduler.release(request)
        self.parts.requests.remove(request.request_id)
