"""A disaggregated request's leg as NeuronConnector sees it: its `kv_transfer_params`, the blocks that
hold its prompt, and (decode_first) the prefill leg a decode worker sends itself. No vLLM here."""
from __future__ import annotations

import logging
from typing import Any

from common.handoff import KV_TRANSFER_PARAMS, HandoffError, LegParams, PrefillParams, parse_leg

log = logging.getLogger(__name__)


def leg_params(params: dict[str, Any] | None, our_role: str) -> LegParams | None:
    """A request's `kv_transfer_params` (as vLLM hands them over) as a leg for this worker's role, with
    its `request_id`; None (logged) when absent or malformed, since a bad request must not stop the
    engine: it is then served without DI."""
    if not params:
        return None
    try:
        leg = parse_leg(params)
    except HandoffError as exc:
        log.warning("%s (in %r); serving without DI", exc, params)
        return None
    if leg.role != our_role:
        log.warning("kv_transfer_params %r are not for a %s worker; serving without DI", params, our_role)
        return None
    if not leg.request_id:
        log.warning("kv_transfer_params %r lack request_id; serving without DI", params)
        return None
    return leg


def prefill_leg_body(model: str, uid: str, prompt_token_ids: list[int]) -> dict[str, Any]:
    """decode_first: the prefill leg a vLLM decode worker sends for `uid`. Only its KV is used (the decode
    worker samples the first token again itself), so it is greedy (no seeded generator: vLLM's CPU
    build cannot prefill a seeded prompt in chunks) and cannot stop before its one token is sampled."""
    return {"model": model, "prompt": prompt_token_ids, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "stream": False, KV_TRANSFER_PARAMS: PrefillParams(uid).to_dict()}


def blocks_holding(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def prompt_blocks(block_ids: list[int], num_prompt_tokens: int, block_size: int) -> tuple[int, ...]:
    """The blocks that hold the prompt's KV (a finished prefill also holds its sampled token's slot)."""
    return tuple(block_ids[:blocks_holding(num_prompt_tokens, block_size)])


def blocks_to_pull(block_ids: list[int], num_prompt_tokens: int, num_external_tokens: int,
                   block_size: int) -> tuple[int, ...]:
    """The prompt blocks decode must receive: all but the full blocks its prefix cache supplied."""
    cached = (num_prompt_tokens - num_external_tokens) // block_size
    return tuple(block_ids[cached:blocks_holding(num_prompt_tokens, block_size)])
