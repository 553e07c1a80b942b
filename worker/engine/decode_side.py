"""Role "decode": a leg's prompt KV is pulled from its prefill worker, then it runs.

With prefix-aware transfer (the scheduler's choice) the leading blocks this worker's prefix
cache holds already are not pulled: only the blocks after them are.
"""
from __future__ import annotations

from dataclasses import replace

from common.handoff import DecodeParams, LegParams
from worker.engine.request import Request, RequestOutput
from worker.engine.roles import DisaggregatedRole, EngineParts, Leg
from worker.engine.kv_connector import KVConnector
from worker.engine.kv_write_back import WriteBackCounts, WriteBackOffers
from worker.engine.stream_handoff import StreamHandOffs, source_blocks
from worker.errors import KVTransferError
from worker.model.sampler import skip_sample


class DecodeSide(DisaggregatedRole):
    """Starts a pull for each admitted leg; a finished pull runs it (first token: the prefill's) or fails it."""

    name = "decode"

    def __init__(self, parts: EngineParts, connector: KVConnector | None = None) -> None:
        super().__init__(parts, connector)
        self.hand_offs = StreamHandOffs(parts, self.kv)   # running streams handed to another decode worker
        self.write_backs = WriteBackOffers(parts, self.kv)   # finished answers' KV held for their prefill worker

    def _leg(self, params: LegParams) -> Leg:
        assert isinstance(params, DecodeParams)
        return Leg(remote_kv=True, pull_target=params)

    def before_step(self) -> list[RequestOutput]:
        scheduler = self.parts.scheduler
        outputs: list[RequestOutput] = []
        results = self.kv.take_finished()
        released = self.kv.take_released()
        self.hand_offs.take_released(released)
        self.write_backs.take_released(released)
        for request_id, token_id in results.done:
            if (request := self._pulled(request_id)) is not None and request.num_output_tokens:
                outputs.extend(self._resumed(request, token_id))
            elif request is not None:
                # Token 1 was sampled on the prefill worker from its copy of this generator.
                skip_sample(self.parts.vocab_size, request.params, request.generator)
                self.kv.pulled(request_id, len(request.block_table) - request.num_cached_blocks,
                               request.num_cached_blocks)
                if self.write_backs.wants(request):
                    request.write_back_target = request.pull_target
                scheduler.transfer_done(request, token_id)
                request.advance(token_id)   # the prefill's token is this request's first output
                outputs.append(self.parts.emit(request, token_id))
        for request_id, error in results.failed:
            if (request := self._pulled(request_id)) is not None:
                outputs.append(self._fail(request, error))
        for request in scheduler.admit_transfers():
            try:
                skipped, end = request.num_cached_blocks, source_blocks(request) if request.num_output_tokens else None
                self.kv.start_pull(request.request_id, request.pull_target, request.block_table[skipped:end], skipped)
            except KVTransferError as exc:
                outputs.append(self._fail(request, exc))
        return outputs

    def after_step(self, seqs: list[Request]) -> None:
        for request in seqs:
            if request.is_finished and request.write_back_target is not None:
                self.write_backs.offer(request)

    def abort(self, request: Request) -> None:
        """A pull the peer may still be writing keeps its blocks until it reports failed. The prefill
        worker is told the request is gone (by the cancel, or without a pull if none started yet)."""
        if request.request_id in self.parts.scheduler.transferring:
            if not self.kv.cancel(request.request_id):
                request.finish_reason = "abort"   # live, cancelling: _pulled frees it
                return
        elif request.remote_kv and request.pull_target is not None:   # still waiting for blocks to pull into
            self.kv.release(request.request_id, request.pull_target)
        super().abort(request)

    def write_back_counts(self) -> WriteBackCounts | None:
        return replace(self.write_backs.counts) if self.kv.config.writes_back else None

    def holds_kv(self) -> bool:
        return self.write_backs.holds_kv

    def has_work(self) -> bool:
        return self.parts.scheduler.can_admit_transfer()

    def _pulled(self, request_id: str) -> Request | None:
        """The request a finished pull belongs to, or None if it was aborted (its blocks go now)."""
        request = self.parts.requests.get(request_id)
        if request is None or request.request_id not in self.parts.scheduler.transferring:
            return None
        if request.finish_reason == "abort":
            self.parts.scheduler.release(request, "abort")
            self.parts.requests.remove(request_id)
            return None
        return request

    def _resumed(self, request: Request, token_id: int) -> list[RequestOutput]:
        """A moved stream's KV arrived (its tokens came with the request): it decodes on from its newest token,
        which the worker it left sent in the place of prefill's first, as a check that the KV is its own."""
        if token_id != request.token_ids[-1]:
            return [self._fail(request, KVTransferError(
                f"the KV pulled for stream {request.request_id!r} ends with token {token_id}, not with its newest "
                f"token {request.token_ids[-1]}", retryable=False))]
        self.kv.pulled(request.request_id, source_blocks(request) - request.num_cached_blocks,
                       request.num_cached_blocks)
        self.parts.scheduler.transfer_done(request, None)
        return []

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        self.parts.scheduler.release(request, "error")
        self.parts.requests.remove(request.request_id)
        return RequestOutput(request.request_id, [], "", True, "error", request.num_prompt_tokens,
                             request.num_output_tokens, error=error)
