"""The engine's hooks for roles prefill and decode, around its schedule / run / postprocess step.

before_step: blocks the prefill side's SendBuffer released go back to the pool; on the decode
side, finished pulls turn into running requests (their first token is the prefill worker's)
or failed ones, and newly admitted requests start their pulls. after_step: the prefill side
publishes every request that just finished, its blocks held until pulled.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from worker.errors import KVTransferError
from worker.request import Request, RequestOutput
from worker.sampler import skip_sample

if TYPE_CHECKING:
    from worker.engine import LLMEngine

logger = logging.getLogger(__name__)


def before_step(engine: LLMEngine) -> list[RequestOutput]:
    kv, scheduler = engine.kv, engine.scheduler
    assert kv is not None
    for request_id in kv.take_released():
        if (seq := scheduler.transferring.get(request_id)) is not None:
            scheduler.release(seq)
    if kv.role != "decode":
        return []
    outputs: list[RequestOutput] = []
    results = kv.poll()
    for request_id, token_id in results.done:
        if (request := _pulled(engine, request_id)) is not None:
            # Token 1 was sampled on the prefill worker from its copy of this generator.
            skip_sample(engine.model_config.vocab_size, request.params, request.generator)
            scheduler.transfer_done(request, token_id)
            outputs.append(engine.output(request, token_id))
    for request_id, error in results.failed:
        if (request := _pulled(engine, request_id)) is not None:
            outputs.append(_fail(engine, request, error))
    for request in scheduler.admit_transfers():
        try:
            kv.start_pull(request.request_id, request.pull_target, list(request.block_table))
        except KVTransferError as exc:
            outputs.append(_fail(engine, request, exc))
    return outputs


def after_step(engine: LLMEngine, seqs: list[Request]) -> None:
    """Prefill: every remote_kv request that just finished waits, blocks held, to be pulled."""
    kv, scheduler = engine.kv, engine.scheduler
    assert kv is not None
    if kv.role != "prefill":
        return
    for seq in seqs:
        if scheduler.transferring.get(seq.request_id) is not seq:
            continue
        try:
            kv.publish(seq.request_id, list(seq.block_table), seq.token_ids[seq.num_prompt_tokens])
        except Exception:  # noqa: BLE001 - nobody can pull it: free the blocks rather than leak them
            logger.exception("could not publish request %s for its decode peer", seq.request_id)
            scheduler.release(seq)


def abort(engine: LLMEngine, request: Request) -> None:
    """Ends an aborted request; a decode pull the peer may still be writing defers its blocks."""
    kv, rid = engine.kv, request.request_id
    assert kv is not None
    if rid in engine.scheduler.transferring and not kv.cancel(rid):
        engine.cancelling[rid] = request  # freed once the pull reports it failed
        request.finish_reason = "abort"
        return
    engine.scheduler.finish(request, "abort")
    if request.remote_kv and kv.role == "prefill":
        kv.discard(rid)  # its decode peer's lookup fails now instead of at its deadline


def _pulled(engine: LLMEngine, request_id: str) -> Request | None:
    """The request a finished pull belongs to, or None if it was aborted (its blocks go now)."""
    cancelled = engine.cancelling.pop(request_id, None)
    if cancelled is not None:
        engine.scheduler.release(cancelled, "abort")
        return None
    return engine.requests.get(request_id)


def _fail(engine: LLMEngine, request: Request, error: Exception) -> RequestOutput:
    engine.scheduler.release(request, "error")
    del engine.requests[request.request_id]
    return RequestOutput(request.request_id, [], "", True, "error", request.num_prompt_tokens,
                         request.num_output_tokens, error=error)
