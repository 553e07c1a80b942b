"""A disaggregated request's leg as NeuronConnector sees it: its `kv_transfer_params`, the blocks that
hold its prompt, and (decode_first) the prefill leg a decode worker sends itself. No vLLM here."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LegParams:
    """A request's `kv_transfer_params` as the proxy sends them; `remote_url` (decode_first): the
    prefill worker's HTTP API, which this decode worker asks for the prompt's KV itself."""

    role: str
    uid: str
    host: str = ""
    port: int = 0
    engine_id: str | None = None
    remote_url: str | None = None

    @classmethod
    def parse(cls, params: dict[str, Any] | None, our_role: str) -> LegParams | None:
        """The params of a leg for this worker's role; None (logged) when absent or malformed,
        since a bad request must not stop the engine: it is then served without DI."""
        if not params or params.get("role") != our_role:
            if params:
                log.warning("kv_transfer_params %r are not for a %s worker; serving without DI", params, our_role)
            return None
        uid, host, port = params.get("request_id"), params.get("remote_host", ""), params.get("remote_port", 0)
        if not isinstance(uid, str) or not uid:
            log.warning("kv_transfer_params %r lack request_id; serving without DI", params)
            return None
        if our_role == "prefill":
            return cls(our_role, uid)
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
                or not 0 < port < 65536:
            log.warning("kv_transfer_params %r lack a prefill address; serving without DI", params)
            return None
        engine_id, url = params.get("remote_engine_id"), params.get("remote_url")
        if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
            log.warning("kv_transfer_params %r name no usable prefill engine; serving without DI", params)
            return None
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            log.warning("kv_transfer_params %r: remote_url is not an http(s) URL; serving without DI", params)
            return None
        return cls(our_role, uid, host, port, engine_id, url.rstrip("/") if url else None)


def prefill_leg_body(model: str, uid: str, prompt_token_ids: list[int]) -> dict[str, Any]:
    """decode_first: the prefill leg a vLLM decode worker sends for `uid`. Only its KV is used (the decode
    worker samples the first token again itself), so it is greedy (no seeded generator: vLLM's CPU
    build cannot prefill a seeded prompt in chunks) and cannot stop before its one token is sampled."""
    return {"model": model, "prompt": prompt_token_ids, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "stream": False, "kv_transfer_params": {"role": "prefill", "request_id": uid}}


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
