"""Role "prefill": each finished leg's KV blocks wait, held, for the decode peer to pull them."""
from __future__ import annotations

import logging
from dataclasses import replace

from common.handoff import LegParams, PrefillParams
from neuron_connector import ConnectorError
from worker.engine.kv_connector import KVConnector
from worker.engine.kv_write_back import WriteBackCounts, WriteBackPulls
from worker.engine.request import Request, RequestOutput
from worker.engine.roles import DisaggregatedRole, EngineParts, Leg

logger = logging.getLogger(__name__)


class PrefillSide(DisaggregatedRole):
    """Publishes every finished `remote_kv` request with the SendBuffer; frees its blocks on release."""

    name = "prefill"

    def __init__(self, parts: EngineParts, connector: KVConnector | None = None) -> None:
        super().__init__(parts, connector)
        # With write-back: the answers' KV decode workers send back, for the prefix cache.
        self.write_backs = WriteBackPulls(parts, self.kv) if self.kv.config.writes_back else None

    def leg(self, request_id: str, params: LegParams | None) -> Leg:
        leg = super().leg(request_id, params)
        if leg.remote_kv:
            self.kv.admitted(request_id, params.decode_engine_id if isinstance(params, PrefillParams) else None)
        return leg

    def write_back_counts(self) -> WriteBackCounts | None:
        return None if self.write_backs is None else replace(self.write_backs.counts)

    def has_work(self) -> bool:
        return self.write_backs is not None and self.kv.has_write_backs()

    def wait_hint(self) -> float | None:
        return None if self.write_backs is None else self.write_backs.wait_hint()

    def holds_kv(self) -> bool:
        return self.write_backs is not None and (self.write_backs.holds_kv or self.kv.has_write_backs())

    def before_step(self) -> list[RequestOutput]:
        scheduler, requests = self.parts.scheduler, self.parts.requests
        for request_id in self.kv.take_released():
            if (seq := scheduler.transferring.get(request_id)) is not None:
                scheduler.release(seq)
                requests.remove(request_id)
        if self.write_backs is not None:
            self.write_backs.before_step()
        return []

    def after_step(self, seqs: list[Request]) -> None:
        scheduler = self.parts.scheduler
        for seq in seqs:
            if scheduler.transferring.get(seq.request_id) is not seq:
                continue
            try:
                self.kv.publish(seq.request_id, list(seq.block_table), seq.token_ids[seq.num_prompt_tokens])
            except ConnectorError:  # the signal plane is down: nobody can pull it, so free the blocks
                logger.exception("could not publish request %s for its decode peer", seq.request_id)
                scheduler.release(seq)
                self.parts.requests.remove(seq.request_id)

    def abort(self, request: Request) -> None:
        super().abort(request)
        if request.remote_kv:
            self.kv.discard(request.request_id)  # its decode peer's lookup fails now, not at its deadline

    def abandon(self, request_id: str) -> None:
        """Its KV, held for a pull, is released (once a running push ends); a leg that arrives
        later is refused as a known id. The proxy abandons a request whose client left when it
        cannot know whether the decode leg ever reached its worker."""
        self.kv.discard(request_id)

    def remembers(self, request_id: str) -> bool:
        return self.kv.remembers(request_id)
